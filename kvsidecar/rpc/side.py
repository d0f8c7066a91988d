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
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvsidecar.errors import BadRequest, Exhausted, RequestError
from kvsidecar.rpc.statuses import status_of
from kvsidecar.tenancy.tickets import TICKET_TTL_S, PeerCred, Tickets, peer_cred
from kvsidecar_contract.limits import MAX_MEMFDS

__all__ = ["SideChannel"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096
MAX_HANDLERS = 16
MAX_HANDLERS_PER_UID = 4  # one uid holding connections open takes its share of the slots, never the others'
IO_TIMEOUT_S = 2.0


FdsHandler = Callable[[str, str, PeerCred, Sequence[int]], int]


class SideChannel:
    """The side socket's listener: a thread accepting connections, one short-lived handler thread each."""

    def __init__(self, path: str, tickets: Tickets, on_fds: FdsHandler) -> None:
        self.path = path
        self.tickets = tickets
        self._on_fds = on_fds
        self._stop = threading.Event()
        self._slots_lock = threading.Lock()
        self._busy = 0
        self._busy_of: dict[int, int] = {}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def bind(self, mode: int, gid: int | None) -> None:
        """Create the socket file (private until its mode is set) and listen."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, mode)
        if gid is not None:
            os.chown(self.path, -1, gid)
        sock.listen(64)
        sock.settimeout(0.2)  # the accept loop checks for stop this often
        self._sock = sock

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._accept_loop, name="kvsidecar-side", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("side socket accept failed: %s", exc)
                time.sleep(0.1)
                continue
            try:
                peer = peer_cred(conn)
            except OSError as exc:
                log.debug("side socket peer gone before its credentials were read: %s", exc)
                conn.close()
                continue
            busy = self._take_slot(peer.uid)
            if busy:
                # Busy with slow peers: refuse rather than queue behind them.
                with contextlib.suppress(OSError):
                    conn.send(_answer(False, busy, code="RESOURCE_EXHAUSTED"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="kvsidecar-side-conn", daemon=True).start()

    def _take_slot(self, uid: int) -> str:
        """Take a handler slot for uid; the refusal (naming the share) when its share or all slots are busy."""
        with self._slots_lock:
            mine = self._busy_of.get(uid, 0)
            if mine >= MAX_HANDLERS_PER_UID:
                return (
                    f"the side socket is busy with {mine} requests of uid {uid} (its share, MAX_HANDLERS_PER_UID): "
                    "try again"
                )
            if self._busy >= MAX_HANDLERS:
                return f"the side socket is busy ({MAX_HANDLERS} requests, MAX_HANDLERS): try again"
            self._busy += 1
            self._busy_of[uid] = mine + 1
            return ""

    def _give_slot(self, uid: int) -> None:
        with self._slots_lock:
            self._busy -= 1
            left = self._busy_of.get(uid, 1) - 1
            if left > 0:
                self._busy_of[uid] = left
            else:
                self._busy_of.pop(uid, None)

    def _serve(self, conn: socket.socket, peer: PeerCred) -> None:
        fds: list[int] = []
        try:
            with conn:
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
        except OSError as exc:
            log.debug("side socket peer gone: %s", exc)
        except Exception:
            log.exception("side socket request failed")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._give_slot(peer.uid)

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
