"""sd_notify without libsystemd: tell the service manager the daemon is ready, busy or stopping."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

__all__ = ["notify", "ready", "status", "stopping"]


def notify(state: str, *, env: Mapping[str, str] = os.environ) -> bool:
    """Send one notification datagram to $NOTIFY_SOCKET; False when there is none or it cannot be reached."""
    if not state:
        raise ValueError("an sd_notify state must not be empty")
    address = env.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        # An abstract socket: systemd writes its leading NUL as '@'.
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        # Unset, or a form this module does not speak (vsock:, relative paths): nobody is listening for us.
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
    except OSError:
        # A missing or refusing socket must never take the daemon down: notification is advisory.
        return False
    return True


def _one_line(text: str) -> str:
    # A newline would start a new assignment, so a status text could forge READY=1 or STOPPING=1.
    return " ".join(text.splitlines())


def ready(status: str | None = None, *, env: Mapping[str, str] = os.environ) -> bool:
    """READY=1, with an optional STATUS= line in the same datagram."""
    return notify("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}", env=env)


def status(text: str, *, env: Mapping[str, str] = os.environ) -> bool:
    """STATUS=<text>, shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}", env=env)


def stopping(*, env: Mapping[str, str] = os.environ) -> bool:
    """STOPPING=1: the daemon has begun a graceful shutdown."""
    return notify("STOPPING=1", env=env)
