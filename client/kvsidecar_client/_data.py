"""The daemon's data socket: Save, Load, their batches and Lookup without gRPC (`kvsidecar_contract.frames`; a
method's frame number and response type are its row's in `kvsidecar_contract.methods`).

Connections are kept per client and bound to its current session (a HELLO with the session's side secret); a call
takes an idle one (or opens one, up to MAX_CONNECTIONS), writes its frame and reads the answer on the calling thread.
Where the data socket cannot serve a call before sending it (no socket file, a daemon that refuses the connection,
every connection busy) the caller gets None and sends it over gRPC; nothing is ever sent twice on a live connection.
A connection found broken on the first write after idling (a restarted daemon) is replaced once: a call the daemon
never read is safe to send again.

One more connection per session carries no calls: its liveness (`hold`). While it is open the daemon keeps the
session, however late a busy engine's KeepAlives come; the kernel closes it when the process exits or is killed, and
the daemon then releases the session at once. A forked child closes its inherited copy, so that it never keeps a
dead parent's session alive.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import grpc

from kvsidecar_client.errors import DaemonUnavailable, DeadlineExceeded, SidecarError, error_for_status
from kvsidecar_contract import frames
from kvsidecar_contract.methods import BY_NAME
from kvsidecar_contract.paths import data_socket_path

__all__ = ["MAX_CONNECTIONS", "DataSocket", "data_socket_for"]

log = logging.getLogger("kvsidecar_client")

MAX_CONNECTIONS = 10  # a rank's 8 save threads and its loads; more callers at once use gRPC
_REFUSED_BACKOFF_S = 1.0  # after the daemon refused a connection, gRPC alone for this long

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def data_socket_for(socket_path: str | None) -> DataSocket | None:
    """The data socket of the daemon whose gRPC socket is at socket_path; None for TCP daemons."""
    return None if socket_path is None else DataSocket(data_socket_path(socket_path))


class _Refused(Exception):
    """The data socket will not take this call: send it over gRPC."""


class DataSocket:
    """A client's connections to one daemon's data socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._session = ""
        self._idle: list[socket.socket] = []
        self._count = 0
        self._refused_until = 0.0
        self._closed = False
        self._liveness: socket.socket | None = None  # the current session's liveness connection (`hold`)
        _HOLDERS.add(self)

    def call(self, session_id: str, secret: bytes, method: str, request: Any, timeout: float) -> Any | None:
        """The call's response over the data socket; None where it should go over gRPC instead (unsent).

        Raises what the gRPC call would have raised: the daemon's refusal with its code and reason, DaemonUnavailable
        for a connection lost during the call, DeadlineExceeded past `timeout` (the connection is then dropped).
        """
        deadline = time.monotonic() + timeout
        body = request.SerializeToString()
        for attempt in range(2):
            try:
                conn, fresh = self._take(session_id, secret, deadline, method)
            except _Refused:
                return None
            try:
                status, payload = _exchange(conn, method, body, deadline)
            except _Stale:
                conn.close()
                self._forget(conn)
                self._drop_idle()  # kept from the same daemon: a restarted one closed them all
                if fresh or attempt:
                    reason = f"data socket {self.path}: the daemon closed the connection"
                    raise DaemonUnavailable(reason, method=method) from None
                continue
            except BaseException:
                conn.close()
                self._forget(conn)
                raise
            self._give(session_id, conn)
            if status != frames.OK:
                code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
                raise error_for_status(code, payload.decode(errors="replace"), method)
            return BY_NAME[method].response.FromString(payload)
        raise AssertionError("unreachable")

    def hold(self, session_id: str, secret: bytes, timeout: float) -> bool:
        """Open the session's liveness connection (closing the previous session's); False where the daemon cannot
        take one (no data socket, refused: its lease alone then keeps the session)."""
        self.let_go()
        with self._lock:
            if self._closed or not secret:
                return False
        try:
            conn = self._connect(session_id, secret, time.monotonic() + timeout, "OpenSession", liveness=True)
        except (_Refused, SidecarError) as error:
            log.debug("no liveness connection for the session (its lease keeps it): %s", error)
            return False
        with self._lock:
            if self._closed:
                conn.close()
                return False
            self._liveness = conn
        return True

    def let_go(self) -> None:
        """Close the liveness connection: the daemon ends its session (if it is still open)."""
        with self._lock:
            conn, self._liveness = self._liveness, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every idle connection and the liveness one; those in use close when their call ends."""
        with self._lock:
            self._closed = True
        self._drop_idle()
        self.let_go()

    def _forget_in_child(self) -> None:
        # After fork, in the child: no lock (another thread of the parent may have held it at the fork). Closing
        # the child's descriptor leaves the parent's connection, and so its session, as it was.
        conn, self._liveness = self._liveness, None
        if conn is not None:
            conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for conn in idle:
            conn.close()

    def _take(self, session_id: str, secret: bytes, deadline: float, method: str) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed or not secret:
                raise _Refused
            if session_id != self._session:
                # A new session: connections bound to the old one are of no use.
                stale, self._idle = self._idle, []
                self._count -= len(stale)
                self._session = session_id
                for conn in stale:
                    conn.close()
            if self._idle:
                return self._idle.pop(), False
            if self._count >= MAX_CONNECTIONS or time.monotonic() < self._refused_until:
                raise _Refused
            self._count += 1
        try:
            return self._connect(session_id, secret, deadline, method), True
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def _connect(
        self, session_id: str, secret: bytes, deadline: float, method: str, *, liveness: bool = False
    ) -> socket.socket:
        if not os.path.exists(self.path):
            raise _Refused  # a daemon without a data socket (older, or TCP only)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.connect(self.path)
            fields: dict[str, Any] = {"session": session_id, "secret": secret.hex()}
            if liveness:
                fields[frames.LIVENESS] = True
            hello = json.dumps(fields).encode()
            conn.sendall(frames.REQUEST.pack(len(hello), frames.HELLO, 0.0) + hello)
            status, payload = _read_reply(conn)
        except (OSError, _Stale) as exc:
            conn.close()
            log.debug("data socket %s unusable, using gRPC: %s", self.path, exc)
            self._back_off()
            raise _Refused from None
        if status != frames.OK:
            conn.close()
            reason = payload.decode(errors="replace")
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            if code is grpc.StatusCode.NOT_FOUND:
                raise error_for_status(code, reason, method)  # the session is gone: the caller re-opens it
            log.info("data socket %s refused the connection (%s), using gRPC: %s", self.path, status, reason)
            self._back_off()
            raise _Refused
        return conn

    def _back_off(self) -> None:
        with self._lock:
            self._refused_until = time.monotonic() + _REFUSED_BACKOFF_S

    def _give(self, session_id: str, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed and session_id == self._session:
                self._idle.append(conn)
                return
            self._count -= 1
        conn.close()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._count -= 1


# Every DataSocket of this process, for the fork hook (weak: a closed client's goes with it).
_HOLDERS: weakref.WeakSet[DataSocket] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for data in list(_HOLDERS):
        data._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Stale(Exception):
    """The connection ended before its answer: the daemon closed it (restarted, stopping, or idle-closed)."""


def _exchange(conn: socket.socket, method: str, body: bytes, deadline: float) -> tuple[int, bytes]:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("no time left for the call", method=method)
    conn.settimeout(left)
    try:
        try:
            conn.sendall(frames.REQUEST.pack(len(body), BY_NAME[method].frame, left) + body)
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale from None
        try:
            return _read_reply(conn)
        except _Stale:
            # Sent, but the answer never came: the daemon may have run the call. Not safe to resend blindly.
            raise DaemonUnavailable("the daemon closed the data socket during the call", method=method) from None
    except TimeoutError:
        raise DeadlineExceeded(f"no answer within {left:.3f} s", method=method) from None
    except OSError as exc:
        raise DaemonUnavailable(f"data socket: {exc}", method=method) from None


def _read_reply(conn: socket.socket) -> tuple[int, bytes]:
    header = _recv_exact(conn, frames.REPLY.size)
    length, status = frames.REPLY.unpack(header)
    return status, _recv_exact(conn, length) if length else b""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = conn.recv_into(view)
        if got == 0:
            raise _Stale
        view = view[got:]
    return bytes(buf)
