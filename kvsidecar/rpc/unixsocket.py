"""A Unix socket beside the gRPC one (the side socket, the data socket): its file, an accept thread that learns each
peer's uid from the kernel, and a share per uid of the connections served at once, one thread each.

A peer past its uid's share, or past the socket's total, is answered with the reason (naming the bound) and closed,
never queued: one uid holding connections open leaves every other uid its share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

from kvsidecar.tenancy.tickets import PeerCred, peer_cred

__all__ = ["UnixListener"]

log = logging.getLogger(__name__)


class UnixListener:
    """The listener; a subclass says what it is (the class attributes) and serves a connection (`_serve`)."""

    KIND = socket.SOCK_STREAM
    BACKLOG = 64
    NAME = "socket"  # for reasons and logs: "the side socket"
    UNIT = "connections"  # what the share counts
    ADVICE = "try again"  # what a refused peer should do
    TOTAL, TOTAL_NAME = 16, "MAX_HANDLERS"
    PER_UID, PER_UID_NAME = 4, "MAX_HANDLERS_PER_UID"

    def __init__(self, path: str) -> None:
        self.path = path
        self._stop = threading.Event()
        self._shares_lock = threading.Lock()
        self._busy = 0
        self._busy_of: dict[int, int] = {}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def bind(self, mode: int, gid: int | None) -> None:
        """Create the socket file (private until its mode is set) and listen."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, self.KIND | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, mode)
        if gid is not None:
            os.chown(self.path, -1, gid)
        sock.listen(self.BACKLOG)
        sock.settimeout(0.2)  # the accept loop checks for stop this often
        self._sock = sock

    def start(self) -> None:
        """Accept in a background thread (connection threads share its network namespace)."""
        name = f"kvsidecar-{self.NAME.split()[0]}"
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _stop_accepting(self) -> None:
        """Stop the accept thread, close the listener and remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self, conn: socket.socket, peer: PeerCred) -> None:
        """Serve one connection until it ends (on its own thread); conn is closed afterwards."""
        raise NotImplementedError

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        """Tell a peer past its share why it is refused (it is closed afterwards)."""
        raise NotImplementedError

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
                log.warning("%s accept failed: %s", self.NAME, exc)
                time.sleep(0.1)
                continue
            try:
                peer = peer_cred(conn)
            except OSError as exc:
                log.debug("%s peer gone before its credentials were read: %s", self.NAME, exc)
                conn.close()
                continue
            busy = self._take(peer.uid)
            if busy:
                with contextlib.suppress(OSError):
                    self._refuse(conn, busy)
                conn.close()
                continue
            name = f"kvsidecar-{self.NAME.split()[0]}-conn"
            threading.Thread(target=self._serve_then_give, args=(conn, peer), name=name, daemon=True).start()

    def _serve_then_give(self, conn: socket.socket, peer: PeerCred) -> None:
        try:
            with conn:
                self._serve(conn, peer)
        except OSError as exc:
            log.debug("%s peer gone: %s", self.NAME, exc)
        except Exception:
            log.exception("%s connection failed", self.NAME)
        finally:
            self._give(peer.uid)

    def _take(self, uid: int) -> str:
        """Count a connection of uid in; the refusal (naming the bound) when its share or every slot is taken."""
        with self._shares_lock:
            mine = self._busy_of.get(uid, 0)
            if mine >= self.PER_UID:
                return (
                    f"the {self.NAME} is busy with {mine} {self.UNIT} of uid {uid} (its share, {self.PER_UID_NAME}): "
                    f"{self.ADVICE}"
                )
            if self._busy >= self.TOTAL:
                return f"the {self.NAME} is busy ({self.TOTAL} {self.UNIT}, {self.TOTAL_NAME}): {self.ADVICE}"
            self._busy += 1
            self._busy_of[uid] = mine + 1
            return ""

    def _give(self, uid: int) -> None:
        with self._shares_lock:
            self._busy -= 1
            left = self._busy_of.get(uid, 1) - 1
            if left > 0:
                self._busy_of[uid] = left
            else:
                self._busy_of.pop(uid, None)
