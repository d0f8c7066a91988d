"""The side socket next to the gRPC one: who a Unix peer is (SO_PEERCRED), and sealed memfds passed with SCM_RIGHTS.

gRPC Python hides the connection's file descriptor, so neither the peer's credentials nor passed descriptors reach a
servicer. This socket (SOCK_SEQPACKET, one request per connection, same mode and group as the gRPC socket) does both:

- `{"op": "ticket"}` answers a single-use ticket bound to the kernel-reported uid and groups of the connecting
  process; the client sends it as `kvsidecar-ticket` metadata on its next gRPC call (OpenSession, Stats), where it
  stands for those credentials. Tickets expire after TICKET_TTL_S and are redeemed once.
- `{"op": "fds", "session": ID, "secret": S}` with up to MAX_MEMFDS descriptors attached hands a session its memfds.
  Accepted only from a peer with the uid that opened the session (its ticket), and with the session's side secret
  from OpenSessionResponse, which travels nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Sequence

from kvsidecar.errors import BadRequest, Exhausted, RequestError
from kvsidecar.rpc.statuses import status_of
from kvsidecar.rpc.unixsocket import UnixListener
from kvsidecar.tenancy.tickets import TICKET_TTL_S, PeerCred, Tickets
from kvsidecar_contract.limits import MAX_MEMFDS

__all__ = ["SideChannel"]


MAX_REQUEST_BYTES = 4096
MAX_HANDLERS = 16
MAX_HANDLERS_PER_UID = 4  # one uid holding connections open takes its share of the slots, never the others'
IO_TIMEOUT_S = 2.0


FdsHandler = Callable[[str, str, PeerCred, Sequence[int]], int]


class SideChannel(UnixListener):
    """The side socket's listener: a thread accepting connections, one short-lived handler thread each."""

    KIND = socket.SOCK_SEQPACKET
    NAME = "side socket"
    UNIT = "requests"
    TOTAL, TOTAL_NAME = MAX_HANDLERS, "MAX_HANDLERS"
    PER_UID, PER_UID_NAME = MAX_HANDLERS_PER_UID, "MAX_HANDLERS_PER_UID"

    def __init__(self, path: str, tickets: Tickets, on_fds: FdsHandler) -> None:
        super().__init__(path)
        self.tickets = tickets
        self._on_fds = on_fds

    def stop(self) -> None:
        """Stop accepting and remove the socket file."""
        self._stop_accepting()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        # Busy with slow peers: refuse rather than queue behind them.
        conn.send(_answer(False, reason, code="RESOURCE_EXHAUSTED"))

    def _serve(self, conn: socket.socket, peer: PeerCred) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(IO_TIMEOUT_S)
            msg, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_MEMFDS)
            try:
                if flags & socket.MSG_TRUNC:
                    raise BadRequest(f"request too large: at most {MAX_REQUEST_BYTES} bytes")
                if flags & socket.MSG_CTRUNC:
                    raise _fds_truncated(len(fds))
                reply = self._handle(msg, fds, peer)
                fds = []  # handed over: the session owns them now
            except RequestError as exc:
                code, reason = status_of(exc)
                reply = _answer(False, reason, code=code.name)
            conn.send(reply)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _handle(self, msg: bytes, fds: list[int], peer: PeerCred) -> bytes:
        try:
            request = json.loads(msg)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("a side-socket request is one JSON object") from None
        if not isinstance(request, dict):
            raise BadRequest("a side-socket request is one JSON object")
        op = request.get("op")
        if op == "ticket":
            if fds:
                raise BadRequest("a ticket request carries no file descriptors")
            return _answer(True, ticket=self.tickets.issue(peer), ttl_s=TICKET_TTL_S)
        if op == "fds":
            session, secret = request.get("session"), request.get("secret")
            if not isinstance(session, str) or not isinstance(secret, str):
                raise BadRequest("an fds request names its session and secret")
            if not fds:
                raise BadRequest("an fds request carries one or more file descriptors (SCM_RIGHTS)")
            count = self._on_fds(session, secret, peer, fds)
            return _answer(True, count=count)
        raise BadRequest(f"unknown side-socket op {str(op)[:40]!r}: ticket or fds")


def _fds_truncated(received: int) -> RequestError:
    """The kernel's MSG_CTRUNC: it dropped passed descriptors, because of the sender or of the daemon's fd limit."""
    if received >= MAX_MEMFDS:
        return BadRequest(
            f"the kernel truncated the passed descriptors (MSG_CTRUNC): at most {MAX_MEMFDS} memfds per message"
        )
    return Exhausted(
        f"the kernel truncated the passed descriptors (MSG_CTRUNC) after {received}: the daemon is at its "
        "open-file limit (RLIMIT_NOFILE) or the descriptors could not be installed; nothing was accepted, try again"
    )


def _answer(ok: bool, error: str = "", **fields: object) -> bytes:
    body: dict[str, object] = {"ok": ok, **fields}
    if error:
        body["error"] = error[:1024]
    return json.dumps(body).encode()
