"""The data socket next to the gRPC one: an engine's saves, loads and lookups without gRPC
(`kvsidecar_contract.frames`).

Each connection is bound to one session by its first frame (the session's side secret, from the uid that opened it)
and served by one daemon thread that reads a call, has the dispatcher run it (dispatch.py, the same as gRPC's) to
the store and writes the answer: no event loop, no pool hop, no HTTP/2. A frame's number names its method-table row
(`kvsidecar_contract.methods`); the dispatcher decides everything a gRPC call's would, and a refusal carries the
same code and reason.

A connection whose HELLO says "liveness" is its session's liveness: the session never expires while it is open
(a busy engine whose KeepAlives come late keeps it), and is released as soon as it closes, which the kernel does
when the process exits or is killed.

A local account cannot starve the daemon through it: connections are bounded in all and per uid (one uid holds at
most its share; a refused client sends its calls over gRPC), a connection that does not say hello in time is
closed, a frame larger than --max-message-bytes closes its connection with the reason, and a call holds one of the
data slots the gRPC data pool shares (a lookup: one of its account's lookup slots, shared with gRPC lookups).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from kvsidecar.errors import BadRequest, Exhausted, RequestError
from kvsidecar.metrics import Metrics
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.handlers import Call
from kvsidecar.rpc.statuses import status_of
from kvsidecar.rpc.unixsocket import UnixListener
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.sessions.session import Session
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar_contract import frames
from kvsidecar_contract.methods import BY_FRAME

__all__ = ["MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_UID", "DataListener"]


MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_UID = 128  # a TP=8 engine's ranks keep up to 10 each and a liveness one; no uid takes all
HELLO_TIMEOUT_S = 2.0
_BODY_CHUNK = 1 << 20


class _Closed(Exception):
    """The peer closed its end (or the daemon shut the connection's read side down to stop)."""


class DataListener(UnixListener):
    """The data socket's listener: a thread accepting connections, one thread serving each."""

    KIND = socket.SOCK_STREAM
    BACKLOG = 256
    NAME = "data socket"
    UNIT = "connections"
    ADVICE = "use gRPC"
    TOTAL, TOTAL_NAME = MAX_CONNECTIONS, "MAX_CONNECTIONS"
    PER_UID, PER_UID_NAME = MAX_CONNECTIONS_PER_UID, "MAX_CONNECTIONS_PER_UID"

    def __init__(
        self, path: str, dispatcher: Dispatcher, sessions: SessionRegistry, metrics: Metrics, max_message_bytes: int
    ) -> None:
        super().__init__(path)
        self.dispatcher = dispatcher
        self.sessions = sessions
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self._open_lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}

    def stop(self, grace: float) -> None:
        """Stop accepting and remove the socket file; idle connections end at once, calls in flight get up to
        `grace` s to answer (the daemon then goes on stopping; the store waits for calls still in it)."""
        self._stop_accepting()
        with self._open_lock:
            open_now = dict(self._open)
        for conn in open_now:
            # Wakes a thread waiting for the next call; one running a call still writes its answer.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + grace
        for thread in open_now.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._open_lock:
            return len(self._open)

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        # The client sends its calls over gRPC instead; nothing queues behind a full socket.
        conn.settimeout(HELLO_TIMEOUT_S)
        _send_reply(conn, _code(Exhausted(reason)), reason.encode())

    def _serve(self, conn: socket.socket, peer: PeerCred) -> None:
        with self._open_lock:
            self._open[conn] = threading.current_thread()
        self.metrics.data_socket_connections.inc()
        try:
            self._calls(conn, peer)
        except _Closed:
            pass
        finally:
            with self._open_lock:
                del self._open[conn]
            self.metrics.data_socket_connections.dec()

    def _calls(self, conn: socket.socket, peer: PeerCred) -> None:
        conn.settimeout(HELLO_TIMEOUT_S)
        hello = self._hello(conn, peer)
        if hello is None:
            return
        session, liveness = hello
        with session.lock:
            session.data_connections += 1
        if liveness:
            self.sessions.hold(session)
        try:
            self._bound_calls(conn, session.id, peer)
        finally:
            with session.lock:
                session.data_connections -= 1
            if liveness:
                # Its process closed it: it exited or died (a daemon stopping ends the session anyway).
                self.sessions.let_go(session)

    def _bound_calls(self, conn: socket.socket, session_id: str, peer: PeerCred) -> None:
        conn.settimeout(None)
        header = bytearray(frames.REQUEST.size)
        while not self._stop.is_set():
            _recv_into(conn, memoryview(header))
            length, method_id, time_left = frames.REQUEST.unpack(header)
            if length > self.max_message_bytes:
                # The stream cannot be trusted past a frame we will not read: answer and close.
                reason = f"a frame of {length} bytes: at most {self.max_message_bytes} (--max-message-bytes)"
                _send_reply(conn, _code(BadRequest(reason)), reason.encode())
                return
            body = _recv_body(conn, length)
            status, payload = self._call(method_id, body, session_id, time_left, peer)
            _send_reply(conn, status, payload)

    def _hello(self, conn: socket.socket, peer: PeerCred) -> tuple[Session, bool] | None:
        """The session the connection is bound to and whether it is the session's liveness connection, after
        answering OK; None after answering the refusal."""
        header = bytearray(frames.REQUEST.size)
        try:
            _recv_into(conn, memoryview(header))
            length, method_id, _ = frames.REQUEST.unpack(header)
            if method_id != frames.HELLO or length > frames.MAX_HELLO_BYTES:
                raise BadRequest(
                    f"a data-socket connection starts with one HELLO frame of at most {frames.MAX_HELLO_BYTES} bytes"
                )
            body = bytearray(length)
            _recv_into(conn, memoryview(body))
            try:
                hello = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                hello = None
            if (
                not isinstance(hello, dict)
                or not all(isinstance(hello.get(k), str) for k in ("session", "secret"))
                or not isinstance(hello.get(frames.LIVENESS, False), bool)
            ):
                raise BadRequest('a HELLO frame is the JSON object {"session": ID, "secret": HEX[, "liveness": BOOL]}')
            session = self.sessions.proven(hello["session"], hello["secret"], peer)
        except RequestError as exc:
            code, reason = status_of(exc)
            _send_reply(conn, code.value[0], reason.encode())
            return None
        except TimeoutError:
            return None
        _send_reply(conn, frames.OK, b"")
        return session, hello.get(frames.LIVENESS, False)

    def _call(
        self, method_id: int, body: bytearray, session_id: str, time_left: float, peer: PeerCred
    ) -> tuple[int, bytes]:
        method = BY_FRAME.get(method_id)
        if method is None:
            known = ", ".join(f"{number} {row.name}" for number, row in BY_FRAME.items())
            reason = f"unknown data-socket method {method_id}: one of {known}"
            return _code(BadRequest(reason)), reason.encode()
        self.metrics.data_socket_requests.labels(method.name).inc()
        try:
            call = Call.of_peer(peer, time_left if time_left > 0 else None)
            response = self.dispatcher.run_here(method, body, call, bound_to=session_id)
        except Exception as exc:
            code, reason = self.dispatcher.refused(method.name, exc)
            return code.value[0], reason.encode()
        return frames.OK, response.SerializeToString()


def _code(exc: Exception) -> int:
    code, _ = status_of(exc)
    return int(code.value[0])


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    """Fill view from the stream; _Closed at its end."""
    while view:
        n = conn.recv_into(view)
        if n == 0:
            raise _Closed
        view = view[n:]


def _recv_body(conn: socket.socket, length: int) -> bytearray:
    """A frame's body of `length` bytes, held only as it arrives: a header alone claiming --max-message-bytes on
    every connection a uid may hold must not make the daemon allocate it."""
    if length <= _BODY_CHUNK:
        body = bytearray(length)
        _recv_into(conn, memoryview(body))
        return body
    body = bytearray()
    while len(body) < length:
        chunk = conn.recv(min(_BODY_CHUNK, length - len(body)))
        if not chunk:
            raise _Closed
        body += chunk
    return body


def _send_reply(conn: socket.socket, status: int, payload: bytes) -> None:
    conn.sendall(frames.REPLY.pack(len(payload), status) + payload)
