"""The daemon's Unix socket paths: a stale socket taken over, a live one refused, and who owns the files."""

from __future__ import annotations

import grp
import logging
import socket
from pathlib import Path

from kvsidecar.errors import DaemonError

__all__ = ["claim_socket", "socket_gid"]

log = logging.getLogger("kvsidecar")


def claim_socket(path: str) -> None:
    """Make `path` free for a new listener: take over a stale socket, refuse a live one or a non-socket."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
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
    raise DaemonError(f"another daemon is serving on {path}")


def socket_gid(group: str) -> int | None:
    """The group that owns the daemon's socket files (--socket-group), if one is named."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise DaemonError(f"cannot give the sockets to group {group!r}: {exc}") from None
