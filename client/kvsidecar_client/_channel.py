"""The gRPC channel to the daemon: target syntax and the options every client channel uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "TcpAuth", "channel_options", "make_channel", "target"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the daemon's default --max-message-bytes

# Reconnect quickly: a restarted daemon on the same node is back within seconds, and gRPC's default backoff (up to
# 120 s) would keep a healthy daemon unused for minutes. Never set grpc.min_reconnect_backoff_ms: gRPC core takes it
# as the minimum time a connection attempt (connect and HTTP/2 handshake) is given (subchannel's min_connect_timeout,
# 20 s by default), so 100 ms failed handshakes on a loaded node and every call on the channel with UNAVAILABLE.
_INITIAL_RECONNECT_BACKOFF_MS = 100
_MAX_RECONNECT_BACKOFF_MS = 500

# HTTP/2 keepalive only while calls are in flight, and no more often than the server's default tolerance (5 min
# between pings without data), or the daemon answers GOAWAY "too_many_pings". On a Unix socket the kernel reports a
# dead daemon at once; a hung one is caught by deadlines and by the session's KeepAlive RPC.
_KEEPALIVE_TIME_MS = 300_000
_KEEPALIVE_TIMEOUT_MS = 20_000


def target(address: str) -> str:
    """A gRPC target: `unix:///abs/path`, `unix:rel/path` and `host:port` pass through; a bare path becomes unix://."""
    if address.startswith("/"):
        return "unix://" + address
    return address


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options of the client channel (message size both ways, reconnect backoff, keepalive)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        # Our own retry logic (re-open on NOT_FOUND) decides what is safe to resend.
        ("grpc.enable_retries", 0),
    ]


@dataclass(frozen=True)
class TcpAuth:
    """How to reach a daemon's TCP listener: TLS (trusting root_ca), a client certificate, and/or a bearer token."""

    root_ca: bytes | None = None  # PEM; None trusts the system's roots
    client_cert: bytes | None = None  # PEM chain, with client_key, for listeners that require client certificates
    client_key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_files(
        cls, root_ca: str = "", client_cert: str = "", client_key: str = "", token_file: str = ""
    ) -> TcpAuth:
        """Read the PEM files and token file that are given (empty paths are skipped)."""

        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        token = Path(token_file).read_text().strip() if token_file else None
        return cls(read(root_ca), read(client_cert), read(client_key), token)

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials, with the token attached to every call."""
        tls = grpc.ssl_channel_credentials(self.root_ca, self.client_key, self.client_cert)
        if self.token is None:
            return tls
        return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(self.token))


def make_channel(
    address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auth: TcpAuth | None = None
) -> grpc.Channel:
    """A channel to the daemon: its node-local Unix socket (plain; file permissions guard it), or TLS over TCP."""
    options = channel_options(max_message_bytes)
    if auth is None:
        return grpc.insecure_channel(target(address), options=options)
    return grpc.secure_channel(target(address), auth.credentials(), options=options)
