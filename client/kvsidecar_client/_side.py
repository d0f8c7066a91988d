"""The daemon's side socket, next to its gRPC socket: tickets proving this process's uid, and passing memfds.

gRPC cannot carry file descriptors or show the daemon who connected, so this small SOCK_SEQPACKET exchange does
(one JSON request per connection; the daemon reads the peer's uid with SO_PEERCRED).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from typing import Any

import grpc

from kvsidecar_client.errors import DaemonUnavailable, error_for_status
from kvsidecar_contract.paths import TICKET_METADATA, side_socket_path

__all__ = ["TICKET_METADATA", "SideSocket", "side_socket_for", "unix_socket_path"]

_MAX_REPLY = 4096


def unix_socket_path(address: str) -> str | None:
    """The socket file of a Unix-socket address (unix:///path, unix:path, /path); None for TCP addresses."""
    if address.startswith("unix://"):
        return address.removeprefix("unix://")
    if address.startswith("unix:"):
        return address.removeprefix("unix:")
    if address.startswith("/"):
        return address
    return None


def side_socket_for(address: str) -> SideSocket | None:
    """The side socket of a daemon at a Unix-socket address; None for TCP addresses (fd passing needs a Unix socket)."""
    path = unix_socket_path(address)
    return None if path is None else SideSocket(side_socket_path(path))


class SideSocket:
    """Requests to the side socket at path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def available(self) -> bool:
        """Whether the daemon serves a side socket (older daemons do not)."""
        return os.path.exists(self.path)

    def ticket(self, timeout: float) -> str | None:
        """A single-use ticket standing for this process's uid on the next gRPC call; None without a side socket."""
        if not self.available():
            return None
        ticket = self._request({"op": "ticket"}, (), timeout, "ticket").get("ticket")
        return ticket if isinstance(ticket, str) else None

    def metadata(self, timeout: float) -> list[tuple[str, str]]:
        """gRPC metadata carrying a fresh ticket (empty without a side socket)."""
        ticket = self.ticket(timeout)
        return [(TICKET_METADATA, ticket)] if ticket else []

    def send_fds(self, session_id: str, secret: bytes, fds: Sequence[int], timeout: float) -> None:
        """Hand the session's memfds to the daemon, before the RegisterMemory that names them by index."""
        body = {"op": "fds", "session": session_id, "secret": secret.hex()}
        self._request(body, fds, timeout, "RegisterMemory")

    def _request(self, body: dict[str, Any], fds: Sequence[int], timeout: float, method: str) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(timeout)
                sock.connect(self.path)
                socket.send_fds(sock, [json.dumps(body).encode()], list(fds))
                raw = sock.recv(_MAX_REPLY)
        except OSError as exc:
            raise DaemonUnavailable(f"side socket {self.path}: {exc}", method=method) from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise DaemonUnavailable(f"side socket {self.path} answered no JSON", method=method) from None
        if not isinstance(reply, dict):
            raise DaemonUnavailable(f"side socket {self.path} answered no JSON object", method=method)
        if not reply.get("ok"):
            code = getattr(grpc.StatusCode, str(reply.get("code")), grpc.StatusCode.UNKNOWN)
            raise error_for_status(code, str(reply.get("error", "refused")), method)
        return reply
