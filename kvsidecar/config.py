"""The daemon's configuration: one object, built from CLI flags and one optional TOML file."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvsidecar_contract.paths import default_socket_path

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9469"
DEFAULT_SEGMENT_BYTES = 1 * GiB
DEFAULT_LOCAL_BUFFER_BYTES = 64 * MiB
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
DEFAULT_SESSION_TTL_S = 10.0
DEFAULT_SSD_BYTES = 8 * GiB  # laptop-sized; see docs/ssd-tier.md for a GPU node
DEFAULT_SSD_BUFFER_BYTES = 64 * MiB  # the disk tier's write queue: about a second of a laptop's saves
DEFAULT_MASTER_CLIENT_TTL_S = 10.0  # mooncake_master --client_ttl


class ConfigError(ValueError):
    """A flag or config-file value that cannot be used."""


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '64M', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (examples: 1GiB, 512MiB, 4096)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Config:
    """Everything `kvsidecar serve` can be told."""

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    socket_group: str = ""
    listen: str = ""  # optional TCP listener host:port; needs TLS and client authentication
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # client certificates signed by this CA are required
    token_file: str = ""  # clients must send `authorization: Bearer <token>`
    tenants: str = ""  # TOML file of tenants: credentials, cache prefixes, budgets (empty: single-tenant)
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    master: str = ""  # empty: start an embedded mooncake_master on loopback
    peer_network: tuple[str, ...] = ()  # with a non-loopback master: who may reach this node's transfer ports
    master_binary: str = ""
    master_lease_ttl_ms: int = 10_000
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_size: int = DEFAULT_SEGMENT_BYTES
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_BYTES
    replicas: int = 1
    session_ttl: float = DEFAULT_SESSION_TTL_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    workers: int = 8
    log_level: str = "info"
    ssd_dir: str = ""  # empty: no disk tier
    ssd_size: int = DEFAULT_SSD_BYTES
    ssd_buffer_size: int = DEFAULT_SSD_BUFFER_BYTES
    master_client_ttl: float = DEFAULT_MASTER_CLIENT_TTL_S

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        if self.segment_size and self.segment_size < 16 * MiB:
            raise ConfigError(f"segment-size must be 0 or >= 16MiB (Mooncake's minimum), got {self.segment_size}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.session_ttl <= 0:
            raise ConfigError(f"session-ttl must be > 0 seconds, got {self.session_ttl}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket-mode must be an octal permission like 0660, got {oct(self.socket_mode)}")
        for name in ("listen", "metrics_address", "master"):
            value = getattr(self, name)
            if value:
                parse_address(value)
        if not self.socket:
            raise ConfigError("socket path must not be empty")
        if self.ssd_dir:
            if not os.path.isabs(self.ssd_dir):
                raise ConfigError(f"ssd-dir must be an absolute path, got {self.ssd_dir!r}")
            if self.ssd_size < 64 * MiB:
                raise ConfigError(f"ssd-size must be at least 64MiB, got {self.ssd_size}")
            if self.ssd_buffer_size < 4 * MiB:
                raise ConfigError(f"ssd-buffer-size must be at least 4MiB, got {self.ssd_buffer_size}")
            if not self.segment_size:
                raise ConfigError(
                    "ssd-dir needs a segment (segment-size > 0): the disk tier is written behind a DRAM one"
                )
        if self.master_client_ttl < 0:
            raise ConfigError(f"master-client-ttl must be >= 0 seconds, got {self.master_client_ttl}")
        self._check_peer_networks()
        if self.listen:
            # The Unix socket is guarded by file permissions; a TCP port has no such guard, so it never runs open.
            if not (self.tls_cert and self.tls_key):
                raise ConfigError("--listen needs --tls-cert and --tls-key: the TCP listener only speaks TLS")
            if not (self.tls_client_ca or self.token_file or self.tenants):
                raise ConfigError(
                    "--listen needs --tls-client-ca, --token-file and/or --tenants: TCP clients must authenticate"
                )
        elif self.tls_cert or self.tls_key or self.tls_client_ca or self.token_file:
            raise ConfigError("TLS and token options only apply to the TCP listener: add --listen HOST:PORT")

    def _check_peer_networks(self) -> None:
        from kvsidecar.fence.bpf import parse_networks
        from kvsidecar.fence.daemon import is_loopback_host

        if isinstance(self.peer_network, (list, str)):  # from a TOML file or a single flag
            networks = [self.peer_network] if isinstance(self.peer_network, str) else self.peer_network
            object.__setattr__(self, "peer_network", tuple(networks))
        try:
            parse_networks(self.peer_network)
        except ValueError as exc:
            raise ConfigError(f"peer-network: {exc}") from None
        if not self.master:
            if self.peer_network:
                raise ConfigError(
                    "--peer-network only applies with --master: the embedded master's node has no peers, and its "
                    "Mooncake ports are closed to everyone"
                )
            return
        host, _ = parse_address(self.master)
        if not is_loopback_host(host) and not self.peer_network:
            # Mooncake's transfer port serves raw reads and writes of engine memory to anyone who connects.
            raise ConfigError(
                f"--master {self.master} joins a Mooncake cluster: name the networks of its nodes with "
                "--peer-network CIDR (repeatable, e.g. --peer-network 10.0.0.0/16); only they (and loopback) may "
                "reach this node's Mooncake transfer ports, which hand out engine memory to whoever connects"
            )


# Fields whose flag may be given several times.
_REPEATABLE = {"peer_network"}

# (flag, type, help); each field of Config has exactly one flag.
_FLAGS: list[tuple[str, Any, str]] = [
    ("socket", str, "Unix socket the gRPC service listens on (default: %(default)s)"),
    ("socket_mode", lambda s: int(s, 8), "permissions of the socket file, octal (default 0660)"),
    ("socket_group", str, "group that owns the socket file (default: the daemon's)"),
    ("listen", str, "also listen on TCP host:port, with TLS and client authentication (default: off)"),
    ("tls_cert", str, "PEM certificate chain of the TCP listener"),
    ("tls_key", str, "PEM private key of the TCP listener"),
    ("tls_client_ca", str, "PEM CA bundle: TCP clients must present a certificate it signed"),
    ("token_file", str, "file holding a bearer token TCP clients must send (authorization: Bearer <token>)"),
    (
        "tenants",
        str,
        "TOML file mapping tenants to credentials (uids/gids, token hashes, certificate subjects), the cache prefixes "
        "they may use and their write budgets; SIGHUP reloads it (default: single-tenant)",
    ),
    ("metrics_address", str, "host:port of the Prometheus /metrics endpoint (default: %(default)s)"),
    ("master", str, "host:port of an existing mooncake_master (default: start one on loopback)"),
    (
        "peer_network",
        str,
        "with --master: a network (CIDR) whose hosts may reach this node's Mooncake transfer ports; repeatable, "
        "IPv4 or IPv6; loopback is always allowed; required unless the master is on loopback",
    ),
    ("master_binary", str, "path of mooncake_master for the embedded master (default: next to python, or PATH)"),
    ("master_lease_ttl_ms", int, "embedded master: how long a read protects a key from eviction (default 10000)"),
    ("metadata_server", str, "Mooncake metadata service: P2PHANDSHAKE, http://host:port/metadata, etcd://..."),
    ("local_hostname", str, "address this node's Mooncake client advertises (default: %(default)s)"),
    ("protocol", str, "Mooncake transport: tcp or rdma (default: %(default)s)"),
    ("rdma_devices", str, "comma-separated RDMA devices (default: Mooncake picks)"),
    (
        "segment_size",
        parse_size,
        "memory this node contributes to the Mooncake pool, e.g. 1GiB (default 1GiB); it is faulted in at start, "
        "so the daemon's resident memory includes it",
    ),
    ("local_buffer_size", parse_size, "Mooncake client transfer buffer, e.g. 64MiB (default 64MiB)"),
    ("replicas", int, "replicas of every stored block (default 1)"),
    ("session_ttl", float, "seconds a session lives without a KeepAlive before its memory is released (default 10)"),
    ("max_message_bytes", parse_size, "largest gRPC message accepted or sent (default 64MiB)"),
    ("workers", int, "threads running saves and loads off the event loop (default 8)"),
    ("log_level", str, "debug, info, warning or error (default info)"),
    (
        "ssd_dir",
        str,
        "absolute directory of a disk tier behind the segment, owned by this daemon alone: every saved block is "
        "written behind to it, served from it once DRAM evicts it, and kept across restarts (default: no disk tier)",
    ),
    ("ssd_size", parse_size, "most bytes the disk tier may use under --ssd-dir, oldest out first (default 8GiB)"),
    (
        "ssd_buffer_size",
        parse_size,
        "disk tier write queue: most bytes copied and waiting for the disk, past which blocks are not written "
        "(counted; DRAM still serves them), e.g. 1GiB on a GPU node (default 64MiB)",
    ),
    (
        "master_client_ttl",
        float,
        "external master's --client_ttl in seconds; no longer used by the disk tier, which needs no wait at restart "
        "(default 10)",
    ),
]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per Config field; unset flags stay None so the file and defaults apply."""
    parser.add_argument("--config", help="TOML file with the same keys as the flags (dashes or underscores)")
    defaults = Config(socket=default_socket_path())
    for name, kind, text in _FLAGS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=None,
            action="append" if name in _REPEATABLE else "store",
            help=text % {"default": getattr(defaults, name)},
        )


def from_args(args: argparse.Namespace) -> Config:
    """Flags override the config file, which overrides the defaults."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_file(Path(args.config)))
    for name, _, _ in _FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    return build(values)


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into Config field values."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    known = {name: kind for name, kind, _ in _FLAGS}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        if name in _REPEATABLE and isinstance(value, list):
            out[name] = tuple(known[name](item) for item in value)
            continue
        try:
            out[name] = known[name](value) if isinstance(value, str) else value
        except ValueError as exc:
            raise ConfigError(f"config file {path}: bad value for {key!r}: {exc}") from None
    return out


def build(values: dict[str, Any]) -> Config:
    """A Config from field values, with every field type checked."""
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = set(values) - fields
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    try:
        return Config(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
