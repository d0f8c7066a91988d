"""What a start checks before it starts anything (no master, no Mooncake, no listener yet): the socket group, the
TCP listener's files, the KV-event endpoints, and a socket mode wider than the default (warned).

The metrics address is checked by binding it, the first thing the daemon does after taking its socket's lock; the
socket path itself is checked by Config (absolute, short enough) and by the lock (its directory, the lock file).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from kvsidecar.daemon.settings import EventSettings, Settings
from kvsidecar.daemon.sockets import DEFAULT_SOCKET_MODE, socket_gid
from kvsidecar.errors import DaemonError
from kvsidecar.parsing import parse_address
from kvsidecar.rpc.auth import TlsSettings, check_files_exist, read_token, server_credentials

__all__ = ["preflight"]

log = logging.getLogger("kvsidecar")


def preflight(settings: Settings) -> int | None:
    """Check everything that can be checked without starting anything; the sockets' group id (None: the daemon's).

    Raises DaemonError or ConfigError with the reason; warns of a socket mode wider than the default."""
    gid = socket_gid(settings.socket.group)
    _check_mode(settings.socket.path, settings.socket.mode)
    if settings.servers.listen:
        _check_tls(settings.servers.tls)
    if settings.events is not None:
        _check_events(settings.events)
    return gid


def _check_mode(path: str, mode: int) -> None:
    # The socket's mode is the first gate (docs/security.md): whoever may connect may open sessions. Bits for
    # accounts outside the owner and group are what widens it past the default.
    if mode & 0o007:
        log.warning(
            "--socket-mode %04o is wider than %04o: every local account of this node may connect to %s and open "
            "sessions; keep %04o and name the engines' group with --socket-group",
            mode,
            DEFAULT_SOCKET_MODE,
            path,
            DEFAULT_SOCKET_MODE,
        )


def _check_tls(tls: TlsSettings) -> None:
    check_files_exist(tls)
    server_credentials(tls)  # reads the certificate, key and CA: an unreadable one fails here, not at the bind
    if tls.token_file:
        read_token(tls.token_file)


def _check_events(events: EventSettings) -> None:
    for flag, endpoint in (
        ("--kv-events-endpoint", events.endpoint),
        ("--kv-events-replay-endpoint", events.replay_endpoint),
    ):
        if endpoint.startswith("ipc://"):
            directory = Path(endpoint.removeprefix("ipc://")).parent
            if not directory.is_dir():
                raise DaemonError(f"{flag} {endpoint}: its directory {directory} does not exist")
        elif endpoint.startswith("tcp://"):
            _check_bindable(flag, endpoint)


def _check_bindable(flag: str, endpoint: str) -> None:
    """A TCP endpoint another process listens on already is refused now, not after the master has started."""
    host, port = parse_address(endpoint.removeprefix("tcp://"))
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no refusal
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise DaemonError(f"{flag} {endpoint}: cannot bind it: {exc.strerror}") from None
