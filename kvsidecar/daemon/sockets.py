"""The daemon's Unix socket paths: one daemon per socket (a lock held for its life), a stale socket taken over, a live
one refused, and who owns the files.

The lock is an flock on SOCKET.lock beside the socket, taken before the daemon starts anything: of any number of
daemons started on one socket at once exactly one gets it, and the others stop with the refusal before they have
started a master or bound a port. The kernel drops an flock however its holder dies, so a crash never blocks the
restart; the file itself stays (removing it would let a new daemon lock a file nobody else can see).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.errors import DaemonError

__all__ = ["DEFAULT_SOCKET_MODE", "MAX_UNIX_PATH_BYTES", "SocketLock", "claim_socket", "socket_gid", "socket_lock_path"]

log = logging.getLogger("kvsidecar")

DEFAULT_SOCKET_MODE = 0o660  # the owner and the engines' group (--socket-group): docs/security.md
# sun_path holds 108 bytes with its NUL; the data and side sockets beside the socket add 5 to its path.
MAX_UNIX_PATH_BYTES = 107


def socket_lock_path(path: str) -> str:
    """The lock file of the socket at path (beside it, in the socket's directory)."""
    return path + ".lock"


@dataclass
class SocketLock:
    """This daemon's hold on its socket path: an exclusive flock, released by release() or the daemon's end."""

    path: str
    fd: int

    def release(self) -> None:
        """Let another daemon have the socket (the lock file stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim_socket(path: str, *, own_directory: bool = False) -> SocketLock:
    """Lock path for this daemon and make it free for a new listener: take over a stale socket, refuse a live one, a
    non-socket, another daemon's lock and a directory that does not exist (own_directory: the default socket's
    directory, which the daemon creates)."""
    directory = Path(path).parent
    if own_directory:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DaemonError(f"cannot create the socket directory {directory}: {exc.strerror}") from None
    elif not directory.is_dir():
        raise DaemonError(
            f"cannot serve on {path}: its directory {directory} does not exist (the daemon creates only its default "
            "socket directory; create this one, with the permissions its users need)"
        )
    lock = _lock(path)
    try:
        _free(path)
    except BaseException:
        lock.release()
        raise
    return lock


def _lock(path: str) -> SocketLock:
    lock_path = socket_lock_path(path)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot serve on {path}: cannot create {lock_path} beside it: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read(fd)
        os.close(fd)
        raise DaemonError(
            f"another daemon is serving on {path}" + (f" (PID {owner}, which holds {lock_path})" if owner else "")
        ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return SocketLock(lock_path, fd)


def _read(fd: int) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return os.pread(fd, 32, 0).decode().strip()
    return ""


def _free(path: str) -> None:
    """Make path free for a new listener: take over a stale socket, refuse a live one or a non-socket."""
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return
    if not p.is_socket():
        raise DaemonError(f"{path} exists and is not a socket: refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("taking over stale socket %s (no daemon answers on it)", path)
            p.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise DaemonError(f"cannot check socket {path}: {exc.strerror}") from None
    # A daemon of an older version, which took no lock.
    raise DaemonError(f"another daemon is serving on {path}")


def socket_gid(group: str) -> int | None:
    """The group that owns the daemon's socket files (--socket-group), if one is named."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise DaemonError(f"cannot give the sockets to group {group!r}: no such group") from None
