"""Config: every setting (fields.py), checked across settings whenever one is made; each check raises a ConfigError
that names the flags and what to give instead."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvsidecar.config.fields import ConfigFields
from kvsidecar.daemon.sockets import MAX_UNIX_PATH_BYTES
from kvsidecar.errors import ConfigError
from kvsidecar.events.endpoints import EndpointError, check_endpoint
from kvsidecar.fence.bpf import parse_networks
from kvsidecar.fence.daemon import is_loopback_host
from kvsidecar.movers.runtime import MODES as GPU_MODES
from kvsidecar.movers.trailer import MODES as CHECKSUM_MODES
from kvsidecar.parsing import MiB, parse_address
from kvsidecar_contract.paths import data_socket_path

__all__ = ["LOG_LEVELS", "Config"]

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Config(ConfigFields):
    """Everything `kvsidecar serve` can be told (ConfigFields), checked when it is made: a Config is a valid one."""

    def __post_init__(self) -> None:
        check(self)


def check(c: ConfigFields) -> None:
    """Raise ConfigError, naming the flags, where settings cannot go together or a value is out of range."""
    if c.protocol not in ("tcp", "rdma"):
        raise ConfigError(f"protocol must be tcp or rdma, got {c.protocol!r}")
    if c.segment_size and c.segment_size < 16 * MiB:
        raise ConfigError(f"segment-size must be 0 or >= 16MiB (Mooncake's minimum), got {c.segment_size}")
    if not c.segment_size and not c.master:
        raise ConfigError(
            "segment-size 0 with the embedded master stores nothing (no node contributes memory): give a "
            "segment (e.g. 1GiB), or --master of a cluster whose nodes contribute theirs"
        )
    if c.log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"log-level must be debug, info, warning or error, got {c.log_level!r}")
    if not c.master_timeout > 0:
        raise ConfigError(f"master-timeout must be > 0 seconds, got {c.master_timeout:g}")
    if c.replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {c.replicas}")
    if c.gpu not in GPU_MODES:
        raise ConfigError(f"gpu must be auto, off or cpu, got {c.gpu!r}")
    if c.checksums not in CHECKSUM_MODES:
        raise ConfigError(f"checksums must be {', '.join(CHECKSUM_MODES)}, got {c.checksums!r}")
    for name in ("gpu_staging_size", "gpu_bounce_size"):
        if getattr(c, name) < 16 * MiB:
            raise ConfigError(f"{name.replace('_', '-')} must be at least 16MiB, got {getattr(c, name)}")
    if c.session_ttl <= 0:
        raise ConfigError(f"session-ttl must be > 0 seconds, got {c.session_ttl}")
    if not 0 < c.max_retention_seconds <= 366 * 86400:
        raise ConfigError(f"max-retention-seconds must be > 0 and at most a year, got {c.max_retention_seconds}")
    for name in (
        "max_registered_bytes",
        "max_registered_bytes_per_account",
        "max_sessions",
        "max_sessions_per_account",
        "max_memfds",
        "max_memfds_per_account",
        "lookups_per_account",
        "lookup_workers",
        "max_lookup_hashes",
        "checksum_every",
    ):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
    if c.workers < 1:
        raise ConfigError(f"workers must be >= 1, got {c.workers}")
    if not 0 <= c.socket_mode <= 0o777:
        raise ConfigError(f"socket-mode must be an octal permission like 0660, got {oct(c.socket_mode)}")
    for name in ("listen", "metrics_address", "master"):
        value = getattr(c, name)
        if value:
            parse_address(value)
    _check_socket(c)
    if c.ssd_dir:
        if not os.path.isabs(c.ssd_dir):
            raise ConfigError(f"ssd-dir must be an absolute path, got {c.ssd_dir!r}")
        if c.ssd_size < 64 * MiB:
            raise ConfigError(f"ssd-size must be at least 64MiB, got {c.ssd_size}")
        if c.ssd_buffer_size < 4 * MiB:
            raise ConfigError(f"ssd-buffer-size must be at least 4MiB, got {c.ssd_buffer_size}")
        if not 0 <= c.master_client_ttl < 86400:
            raise ConfigError(f"master-client-ttl must be 0-86400 seconds, got {c.master_client_ttl:g}")
        if not c.segment_size:
            raise ConfigError("ssd-dir needs a segment (segment-size > 0): the disk tier is written behind a DRAM one")
    _check_peer_networks(c)
    _check_kv_events(c)
    if c.listen:
        # The Unix socket is guarded by file permissions; a TCP port has no such guard, so it never runs open.
        if not (c.tls_cert and c.tls_key):
            raise ConfigError("--listen needs --tls-cert and --tls-key: the TCP listener only speaks TLS")
        if not (c.tls_client_ca or c.token_file or c.tenants):
            raise ConfigError(
                "--listen needs --tls-client-ca, --token-file and/or --tenants: TCP clients must authenticate"
            )
    elif c.tls_cert or c.tls_key or c.tls_client_ca or c.token_file:
        raise ConfigError("TLS and token options only apply to the TCP listener: add --listen HOST:PORT")


def _check_socket(c: ConfigFields) -> None:
    if not os.path.isabs(c.socket):
        raise ConfigError(f"socket must be an absolute path, got {c.socket!r}")
    longest = len(os.fsencode(data_socket_path(c.socket)))
    if longest > MAX_UNIX_PATH_BYTES:
        raise ConfigError(
            f"socket path {c.socket!r} is too long: a Unix socket path holds at most {MAX_UNIX_PATH_BYTES} "
            f"bytes, and the daemon's data socket beside it ({data_socket_path(c.socket)!r}) takes {longest}"
        )


def _check_kv_events(c: ConfigFields) -> None:
    if c.kv_events_replay_endpoint and not c.kv_events_endpoint:
        raise ConfigError("--kv-events-replay-endpoint replays --kv-events-endpoint's messages: set that too")
    try:
        for flag, value in (
            ("--kv-events-endpoint", c.kv_events_endpoint),
            ("--kv-events-replay-endpoint", c.kv_events_replay_endpoint),
        ):
            if value:
                check_endpoint(value, flag, c.kv_events_remote)
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None


def _check_peer_networks(c: ConfigFields) -> None:
    if not isinstance(c.peer_network, tuple):
        raise ConfigError(f"peer-network must be a tuple of networks, got {type(c.peer_network).__name__}")
    try:
        parse_networks(c.peer_network)
    except ValueError as exc:
        raise ConfigError(f"peer-network: {exc}") from None
    if not c.master:
        if c.peer_network:
            raise ConfigError(
                "--peer-network only applies with --master: the embedded master's node has no peers, and its "
                "Mooncake ports are closed to everyone"
            )
        return
    host, _ = parse_address(c.master)
    if not is_loopback_host(host) and not c.peer_network:
        # Mooncake's transfer port serves raw reads and writes of engine memory to anyone who connects.
        raise ConfigError(
            f"--master {c.master} joins a Mooncake cluster: name the networks of its nodes with "
            "--peer-network CIDR (repeatable, e.g. --peer-network 10.0.0.0/16); only they (and loopback) may "
            "reach this node's Mooncake transfer ports, which hand out engine memory to whoever connects"
        )
