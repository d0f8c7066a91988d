"""The gRPC servers of one daemon: the Unix socket's and, with --listen, an authenticated TLS one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvsidecar.errors import DaemonError
from kvsidecar.metrics import Metrics
from kvsidecar.parsing import parse_address
from kvsidecar.rpc import wire
from kvsidecar.rpc.auth import TlsSettings, TokenAuth, check_files_exist, read_token, server_credentials
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.servicer import sidecar_service

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "DISK_TIER_HEALTH", "SERVICE_NAME", "ServerSettings", "create_servers"]

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the largest gRPC message accepted or sent
SERVICE_NAME = wire.SERVICE_NAME
# The health service's name for the disk tier (with --ssd-dir): NOT_SERVING while it does not write (full, failing).
DISK_TIER_HEALTH = "kvsidecar.disk_tier"


@dataclass(frozen=True)
class ServerSettings:
    """What the gRPC servers are told (cut from Config): the Unix socket, the TCP listener, the message limits."""

    socket: str
    socket_mode: int
    socket_group: str  # its name, for the refusal; the gid is resolved by the caller
    max_message_bytes: int
    listen: str  # host:port of the TLS listener, "" for none
    tls: TlsSettings
    # Without client certificates, a tenants file's tokens guard the listener (as --token-file's does).
    tenants: bool


def _server(
    dispatcher: Dispatcher, health: health_aio.HealthServicer, config: ServerSettings, **kw: Any
) -> grpc.aio.Server:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, **kw)
    # A Lookup's request is parsed on the event loop, before --max-lookup-hashes could refuse it: its size is
    # refused first (its row's limit), so one account's huge lookups cannot stall every other call (docs/security.md).
    server.add_generic_rpc_handlers((sidecar_service(dispatcher),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server


def create_servers(
    dispatcher: Dispatcher, config: ServerSettings, metrics: Metrics, socket_gid: int | None
) -> tuple[list[grpc.aio.Server], health_aio.HealthServicer, list[str]]:
    """The Unix-socket server (on a path the caller has claimed) and, with --listen, an authenticated TLS one;
    bound, not started."""
    health = health_aio.HealthServicer()
    unix = _server(dispatcher, health, config)
    # The socket file appears at bind time; a tight umask keeps it private until its mode is set.
    old = os.umask(0o177)
    try:
        unix.add_insecure_port(f"unix://{config.socket}")
    finally:
        os.umask(old)
    os.chmod(config.socket, config.socket_mode)
    if socket_gid is not None:
        try:
            os.chown(config.socket, -1, socket_gid)
        except PermissionError as exc:
            raise DaemonError(f"cannot give {config.socket} to group {config.socket_group!r}: {exc}") from None
    servers, addresses = [unix], [f"unix://{config.socket}"]
    if config.listen:
        check_files_exist(config.tls)
        interceptors = []
        refused = metrics.requests_rejected
        tenancy = dispatcher.handlers.tenancy
        # With client certificates, a tenants file's own credentials decide at OpenSession; without them the
        # tenants' tokens guard the listener, as --token-file's does.
        if config.tls.token_file or (config.tenants and not config.tls.client_ca):
            token = read_token(config.tls.token_file) if config.tls.token_file else None
            interceptors.append(
                TokenAuth(token, lambda method: refused.labels(method, "UNAUTHENTICATED").inc(), tenancy.token_hashes)
            )
        tcp = _server(dispatcher, health, config, interceptors=interceptors)
        port = tcp.add_secure_port(config.listen, server_credentials(config.tls))
        if not port:
            raise DaemonError(f"cannot listen on {config.listen}")
        host, _ = parse_address(config.listen)
        servers.append(tcp)
        addresses.append(f"{host}:{port}")
    return servers, health, addresses
