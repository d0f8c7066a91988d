"""The daemon's configuration: one object, built from CLI flags and one optional TOML file.

Each setting is declared once, as a field of `Config` with its help text, parser and flag group beside it
(`setting`); the flags, `serve --help`'s sections, the config file's keys and the defaults all come from those fields.

Imports: errors, fence (the peer networks' parser), events (which event endpoints may be bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvsidecar.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvsidecar_contract.paths import data_socket_path, default_socket_path

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9469"
DEFAULT_SOCKET_MODE = 0o660
DEFAULT_SEGMENT_BYTES = 1 * GiB
DEFAULT_LOCAL_BUFFER_BYTES = 64 * MiB
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
DEFAULT_SESSION_TTL_S = 10.0
DEFAULT_GPU_STAGING_BYTES = 256 * MiB  # per GPU: a 4k-token 8B prefix (512 MiB) loads in two rounds
DEFAULT_GPU_BOUNCE_BYTES = 64 * MiB
DEFAULT_SSD_BYTES = 8 * GiB  # laptop-sized; see docs/ssd-tier.md for a GPU node
DEFAULT_SSD_BUFFER_BYTES = 64 * MiB  # the disk tier's write queue: about a second of a laptop's saves
TiB = 1 << 40
# Fair shares, sized for a GPU node (8 GPUs, 1-2 TiB of host memory, one engine uid or a few): see docs/security.md.
DEFAULT_MAX_REGISTERED_BYTES = 1 * TiB  # host memory (memfds, /dev/shm) registered by all sessions together
DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT = 512 * GiB  # ... by one tenant (tenants file: max_registered_bytes) or uid
DEFAULT_MAX_SESSIONS = 4096
DEFAULT_MAX_SESSIONS_PER_ACCOUNT = 1024
DEFAULT_MAX_LOOKUP_HASHES = 1 << 17  # a 2M-token prompt at 16-token blocks; one call's work holds the GIL throughout
DEFAULT_MAX_MEMFDS = 4096  # memfds parked or mapped (each mapped one holds two of the daemon's descriptors)
DEFAULT_MAX_MEMFDS_PER_ACCOUNT = 1024
# An unreachable master fails the start this soon (Mooncake's own setup retries it for ~90 s).
DEFAULT_MASTER_TIMEOUT_S = 5.0
LOG_LEVELS = ("debug", "info", "warning", "error")
# sun_path holds 108 bytes with its NUL; the data and side sockets beside the socket add 5 to its path.
MAX_UNIX_PATH_BYTES = 107


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '64M', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (a number of bytes, with an optional unit: 4096, 512MiB, 64M, 1GiB)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise ConfigError(f"not an octal permission: {text!r} (e.g. 0660)") from None


# What a value of a plain Python parser looks like, for the message when it is not one.
_LOOKS_LIKE: dict[Callable[[str], Any], str] = {int: "a whole number", float: "a number"}


def parse_text(parse: Callable[[str], Any], text: str) -> Any:
    """A flag's or config file's text as its setting's value; ConfigError says what the value should look like."""
    try:
        return parse(text)
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(f"not {_LOOKS_LIKE.get(parse, 'a valid value')}: {text!r}") from None


def _flag_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"not a boolean: {text!r} (true or false)")


class FlagGroup(NamedTuple):
    """A section of `kvsidecar serve --help`."""

    title: str
    description: str


SOCKETS = FlagGroup("sockets", "where engines and tools reach the daemon: its Unix socket and an optional TCP listener")
STORE = FlagGroup("store", "the Mooncake master (embedded, or a cluster's) and this node's Mooncake client")
DISK_TIER = FlagGroup("disk tier", "a disk behind the segment, the daemon's own (docs/ssd-tier.md)")
TENANCY = FlagGroup("tenancy", "who may use which cache prefixes, and what local accounts are trusted with")
LIMITS = FlagGroup("limits", "what one account and all of them together may hold, and the daemon's threads")
EVENTS = FlagGroup("events", "KV events for prefix-aware routers (docs/kv-events.md)")
GPU = FlagGroup("gpu", "the GPU data path on a node with an NVIDIA driver (a CPU node never starts CUDA)")
LOGGING = FlagGroup("logging and metrics", "the daemon's log and its Prometheus endpoint")
# The order of `serve --help`.
FLAG_GROUPS = (SOCKETS, STORE, GPU, DISK_TIER, TENANCY, LIMITS, EVENTS, LOGGING)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: FlagGroup,
    parse: Callable[[str], Any] = str,
    repeatable: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A Config field that is also a flag: its help text, its section of `serve --help`, how a flag's text becomes
    its value, and whether the flag may be given several times (then the value is a tuple, and a config file gives a
    list)."""
    metadata = {"help": help, "group": group, "parse": parse, "repeatable": repeatable}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"not a host:port address: {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Config:
    """Everything `kvsidecar serve` can be told: each field is one flag (`--name-with-dashes`) and one config key."""

    socket: str = setting(
        default_factory=default_socket_path,
        help="Unix socket the gRPC service listens on (default: %(default)s)",
        group=SOCKETS,
    )
    socket_mode: int = setting(
        DEFAULT_SOCKET_MODE, help="permissions of the socket file, octal (default 0660)", parse=_octal, group=SOCKETS
    )
    socket_group: str = setting("", help="group that owns the socket file (default: the daemon's)", group=SOCKETS)
    listen: str = setting(
        "", help="also listen on TCP host:port, with TLS and client authentication (default: off)", group=SOCKETS
    )
    tls_cert: str = setting("", help="PEM certificate chain of the TCP listener", group=SOCKETS)
    tls_key: str = setting("", help="PEM private key of the TCP listener", group=SOCKETS)
    tls_client_ca: str = setting(
        "", help="PEM CA bundle: TCP clients must present a certificate it signed", group=SOCKETS
    )
    token_file: str = setting(
        "", help="file holding a bearer token TCP clients must send (authorization: Bearer <token>)", group=SOCKETS
    )
    tenants: str = setting(
        "",
        help=(
            "TOML file mapping tenants to credentials (uids/gids, token hashes, certificate subjects), the cache "
            "prefixes they may use and their write budgets; SIGHUP reloads it (default: single-tenant)"
        ),
        group=TENANCY,
    )
    allow_shm_names: bool = setting(
        False,
        help=(
            "single-tenant: accept /dev/shm segment names from this node's ranks (trusted ranks only: a named "
            "segment can be truncated under a transfer; sealed memfds need no trust); with --tenants, each "
            "tenant's shm_names decides (default: off)"
        ),
        parse=bool,
        group=TENANCY,
    )
    trust_local_accounts: bool = setting(
        False,
        help=(
            "with --tenants where nothing guards the embedded master's loopback ports (the daemon cannot make a "
            "private network namespace: no CAP_SYS_ADMIN): run anyway, trusting every local account of this node "
            "with the master (list, remove and place keys); a pod's own network namespace is such a node "
            "(default: refuse)"
        ),
        parse=bool,
        group=TENANCY,
    )
    retained_bytes: int = setting(
        -1,
        help=(
            "without --tenants: the bytes requests may keep ahead of ordinary cache (retention, docs/retention.md), "
            "e.g. 512MiB (default: half of --segment-size; 0: none); with --tenants, each tenant's retained_bytes"
        ),
        parse=parse_size,
        group=TENANCY,
    )
    max_retention_seconds: float = setting(
        86400.0,
        help=(
            "the longest a request may ask its values to be kept (longer asks get this); the embedded master is "
            "started with it, an external master's --max_kv_soft_pin_ttl must be at least as long (default 86400)"
        ),
        parse=float,
        group=TENANCY,
    )
    metrics_address: str = setting(
        DEFAULT_METRICS_ADDRESS,
        help="host:port of the Prometheus /metrics endpoint (default: %(default)s)",
        group=LOGGING,
    )
    master: str = setting(
        "", help="host:port of an existing mooncake_master (default: start one on loopback)", group=STORE
    )
    peer_network: tuple[str, ...] = setting(
        (),
        help=(
            "with --master: a network (CIDR) whose hosts may reach this node's Mooncake transfer ports; "
            "repeatable, IPv4 or IPv6; loopback is always allowed; required unless the master is on loopback"
        ),
        repeatable=True,
        group=STORE,
    )
    master_binary: str = setting(
        "", help="path of mooncake_master for the embedded master (default: next to python, or PATH)", group=STORE
    )
    master_timeout: float = setting(
        DEFAULT_MASTER_TIMEOUT_S,
        help=(
            "seconds the start waits for the Mooncake master to accept connections and set this node up before it "
            "gives up (default 5); raise it where the daemon may start before its master"
        ),
        parse=float,
        group=STORE,
    )
    master_lease_ttl_ms: int = setting(
        10_000,
        help="embedded master: how long a read protects a key from eviction (default 10000)",
        parse=int,
        group=STORE,
    )
    metadata_server: str = setting(
        "P2PHANDSHAKE",
        help="Mooncake metadata service: P2PHANDSHAKE, http://host:port/metadata, etcd://...",
        group=STORE,
    )
    local_hostname: str = setting(
        "127.0.0.1", help="address this node's Mooncake client advertises (default: %(default)s)", group=STORE
    )
    protocol: str = setting("tcp", help="Mooncake transport: tcp or rdma (default: %(default)s)", group=STORE)
    rdma_devices: str = setting("", help="comma-separated RDMA devices (default: Mooncake picks)", group=STORE)
    segment_size: int = setting(
        DEFAULT_SEGMENT_BYTES,
        help=(
            "memory this node contributes to the Mooncake pool, e.g. 1GiB (default 1GiB); it is faulted in at "
            "start, so the daemon's resident memory includes it"
        ),
        parse=parse_size,
        group=STORE,
    )
    local_buffer_size: int = setting(
        DEFAULT_LOCAL_BUFFER_BYTES,
        help="Mooncake client transfer buffer, e.g. 64MiB (default 64MiB)",
        parse=parse_size,
        group=STORE,
    )
    replicas: int = setting(1, help="replicas of every stored block (default 1)", parse=int, group=STORE)
    gpu: str = setting(
        "auto",
        help=(
            "the GPU data path for ranks whose KV cache is CUDA memory: auto (on a node with an NVIDIA driver and "
            "Mooncake's CUDA build: CUDA started and the segment page-locked in the background at start), off (CUDA "
            "memory refused; a CPU node never starts CUDA), or cpu (tests: a CPU stands in for a GPU and host memory "
            "moves through the device path) (default auto)"
        ),
        group=GPU,
    )
    gpu_staging_size: int = setting(
        DEFAULT_GPU_STAGING_BYTES,
        help=(
            "GPU memory per device the daemon gathers and scatters a batch of blocks in, e.g. 256MiB (default "
            "256MiB); a larger request moves in rounds"
        ),
        parse=parse_size,
        group=GPU,
    )
    gpu_bounce_size: int = setting(
        DEFAULT_GPU_BOUNCE_BYTES,
        help=(
            "pinned host memory per device for values read from another node or the disk tier on their way to a GPU, "
            "e.g. 64MiB (default 64MiB)"
        ),
        parse=parse_size,
        group=GPU,
    )
    session_ttl: float = setting(
        DEFAULT_SESSION_TTL_S,
        help="seconds a session lives without a KeepAlive before its memory is released (default 10); a session whose "
        "client holds a liveness connection on the data socket lives exactly as long as that connection instead",
        parse=float,
        group=LIMITS,
    )
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message accepted or sent (default 64MiB)",
        parse=parse_size,
        group=LIMITS,
    )
    workers: int = setting(
        8, help="threads running saves and loads off the event loop (default 8)", parse=int, group=LIMITS
    )
    log_level: str = setting("info", help="debug, info, warning or error (default info)", group=LOGGING)
    ssd_dir: str = setting(
        "",
        help=(
            "absolute directory of a disk tier behind the segment, owned by this daemon alone: every saved block is "
            "written behind to it, served from it once DRAM evicts it, and kept across restarts (default: no disk "
            "tier)"
        ),
        group=DISK_TIER,
    )
    ssd_size: int = setting(
        DEFAULT_SSD_BYTES,
        help="most bytes the disk tier may use under --ssd-dir, oldest out first (default 8GiB)",
        parse=parse_size,
        group=DISK_TIER,
    )
    ssd_buffer_size: int = setting(
        DEFAULT_SSD_BUFFER_BYTES,
        help=(
            "disk tier write queue: most bytes copied and waiting for the disk, past which blocks are not written "
            "(counted; DRAM still serves them), e.g. 1GiB on a GPU node (default 64MiB)"
        ),
        parse=parse_size,
        group=DISK_TIER,
    )
    master_client_ttl: float = setting(
        10.0,
        help=(
            "with --master and --ssd-dir: the master's --client_ttl in seconds (Mooncake's default 10), how long it "
            "lists a killed daemon's segment; a daemon restarted after a kill reads from its disk alone until then "
            "(default 10)"
        ),
        parse=float,
        group=DISK_TIER,
    )

    kv_events_endpoint: str = setting(
        "",
        help=(
            "publish vLLM-format KV events (BlockStored, BlockRemoved, AllBlocksCleared) for routers on this ZeroMQ "
            "PUB endpoint, e.g. tcp://127.0.0.1:5557 or ipc:///run/kvsidecar/events (default: off; see "
            "docs/kv-events.md)"
        ),
        group=EVENTS,
    )
    kv_events_replay_endpoint: str = setting(
        "", help="ZeroMQ ROUTER endpoint replaying recent KV-event messages (default: off)", group=EVENTS
    )
    kv_events_topic: str = setting(
        "kvsidecar", help="KV-event topic; a tenant's events go to TOPIC.TENANT (default: %(default)s)", group=EVENTS
    )
    kv_events_remote: bool = setting(
        False,
        help="the KV-event endpoints may listen off loopback (events name cached prefixes; default: off)",
        parse=bool,
        group=EVENTS,
    )

    max_registered_bytes: int = setting(
        DEFAULT_MAX_REGISTERED_BYTES,
        help=(
            "host memory (memfds, /dev/shm segments) all sessions together may register, e.g. 1TiB (default 1TiB); "
            "a rank that punches holes in its memory can make the daemon fault at most this back in on its own "
            "account, so size the daemon's memory limit for segment-size plus this where ranks are untrusted"
        ),
        parse=parse_size,
        group=LIMITS,
    )
    max_registered_bytes_per_account: int = setting(
        DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT,
        help=(
            "host memory one account may register: a tenant (its max_registered_bytes in the tenants file "
            "overrides this) or, without a tenants file, a uid (default 512GiB)"
        ),
        parse=parse_size,
        group=LIMITS,
    )
    max_sessions: int = setting(
        DEFAULT_MAX_SESSIONS, help="open sessions, all accounts (default 4096)", parse=int, group=LIMITS
    )
    max_sessions_per_account: int = setting(
        DEFAULT_MAX_SESSIONS_PER_ACCOUNT,
        help="open sessions of one tenant or uid (default 1024)",
        parse=int,
        group=LIMITS,
    )
    # One vLLM scheduler is one account: 2 at once answer a step's burst of arrivals in half the time of 1 (8 x
    # 16k-token lookups: 181 ms, not 388), and another account keeps half the threads (its p99 under issue 22's
    # attack 108 ms, against 192 with 1 of 2): benchmarks/lookup_wait.py --arrivals, lookup_fairness.py.
    lookups_per_account: int = setting(
        2,
        help=(
            "lookups of one tenant or uid running at once; more wait their turn, so one account's huge lookups "
            "cannot hold every lookup thread (default 2, of --lookup-workers 4)"
        ),
        parse=int,
        group=LIMITS,
    )
    max_lookup_hashes: int = setting(
        DEFAULT_MAX_LOOKUP_HASHES,
        help=(
            "block hashes one Lookup may probe (default 131072: a 2M-token prompt at 16-token blocks); a bigger "
            "call is refused with this limit named, so one client's huge lookups cannot stall the others'"
        ),
        parse=int,
        group=LIMITS,
    )
    lookup_workers: int = setting(
        4, help="threads running lookups, apart from saves and loads (default 4)", parse=int, group=LIMITS
    )
    max_memfds: int = setting(
        DEFAULT_MAX_MEMFDS,
        help="memfds held for all sessions, parked or mapped (default 4096)",
        parse=int,
        group=LIMITS,
    )
    max_memfds_per_account: int = setting(
        DEFAULT_MAX_MEMFDS_PER_ACCOUNT,
        help="memfds held for one tenant's or uid's sessions (default 1024)",
        parse=int,
        group=LIMITS,
    )

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        if self.segment_size and self.segment_size < 16 * MiB:
            raise ConfigError(f"segment-size must be 0 or >= 16MiB (Mooncake's minimum), got {self.segment_size}")
        if not self.segment_size and not self.master:
            raise ConfigError(
                "segment-size 0 with the embedded master stores nothing (no node contributes memory): give a "
                "segment (e.g. 1GiB), or --master of a cluster whose nodes contribute theirs"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log-level must be debug, info, warning or error, got {self.log_level!r}")
        if not self.master_timeout > 0:
            raise ConfigError(f"master-timeout must be > 0 seconds, got {self.master_timeout:g}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.gpu not in ("auto", "off", "cpu"):
            raise ConfigError(f"gpu must be auto, off or cpu, got {self.gpu!r}")
        for name in ("gpu_staging_size", "gpu_bounce_size"):
            if getattr(self, name) < 16 * MiB:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 16MiB, got {getattr(self, name)}")
        if self.session_ttl <= 0:
            raise ConfigError(f"session-ttl must be > 0 seconds, got {self.session_ttl}")
        if not 0 < self.max_retention_seconds <= 366 * 86400:
            raise ConfigError(f"max-retention-seconds must be > 0 and at most a year, got {self.max_retention_seconds}")
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
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket-mode must be an octal permission like 0660, got {oct(self.socket_mode)}")
        for name in ("listen", "metrics_address", "master"):
            value = getattr(self, name)
            if value:
                parse_address(value)
        self._check_socket()
        if self.ssd_dir:
            if not os.path.isabs(self.ssd_dir):
                raise ConfigError(f"ssd-dir must be an absolute path, got {self.ssd_dir!r}")
            if self.ssd_size < 64 * MiB:
                raise ConfigError(f"ssd-size must be at least 64MiB, got {self.ssd_size}")
            if self.ssd_buffer_size < 4 * MiB:
                raise ConfigError(f"ssd-buffer-size must be at least 4MiB, got {self.ssd_buffer_size}")
            if not 0 <= self.master_client_ttl < 86400:
                raise ConfigError(f"master-client-ttl must be 0-86400 seconds, got {self.master_client_ttl:g}")
            if not self.segment_size:
                raise ConfigError(
                    "ssd-dir needs a segment (segment-size > 0): the disk tier is written behind a DRAM one"
                )
        self._check_peer_networks()
        self._check_kv_events()
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

    def _check_socket(self) -> None:
        if not os.path.isabs(self.socket):
            raise ConfigError(f"socket must be an absolute path, got {self.socket!r}")
        longest = len(os.fsencode(data_socket_path(self.socket)))
        if longest > MAX_UNIX_PATH_BYTES:
            raise ConfigError(
                f"socket path {self.socket!r} is too long: a Unix socket path holds at most {MAX_UNIX_PATH_BYTES} "
                f"bytes, and the daemon's data socket beside it ({data_socket_path(self.socket)!r}) takes {longest}"
            )

    def _check_kv_events(self) -> None:
        from kvsidecar.events.endpoints import EndpointError, check_endpoint

        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint replays --kv-events-endpoint's messages: set that too")
        try:
            for flag, value in (
                ("--kv-events-endpoint", self.kv_events_endpoint),
                ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint),
            ):
                if value:
                    check_endpoint(value, flag, self.kv_events_remote)
        except EndpointError as exc:
            raise ConfigError(str(exc)) from None

    def _check_peer_networks(self) -> None:
        from kvsidecar.fence.bpf import parse_networks
        from kvsidecar.fence.daemon import is_loopback_host

        if not isinstance(self.peer_network, tuple):
            raise ConfigError(f"peer-network must be a tuple of networks, got {type(self.peer_network).__name__}")
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


def _settings() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(Config))


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse for argparse, whose message for a bad value is then ConfigError's (not "invalid parse_size value")."""

    def flag_value(text: str) -> Any:
        try:
            return parse_text(parse, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return flag_value


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per Config field, in their groups; unset flags stay None so the file and defaults
    apply."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with the same keys as the flags (dashes or underscores)"
    )
    sections = {group: parser.add_argument_group(group.title, group.description) for group in FLAG_GROUPS}
    defaults = Config(socket=default_socket_path())
    for f in _settings():
        meta = f.metadata
        section = sections[meta["group"]]
        flag = "--" + f.name.replace("_", "-")
        text = meta["help"] % {"default": getattr(defaults, f.name)}
        if meta["parse"] is bool:
            section.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=text)
            continue
        section.add_argument(
            flag,
            dest=f.name,
            type=_flag_type(meta["parse"]),
            default=None,
            action="append" if meta["repeatable"] else "store",
            help=text,
        )


def from_args(args: argparse.Namespace) -> Config:
    """Flags override the config file, which overrides the defaults."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_file(Path(args.config)))
    for f in _settings():
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
    return build(values)


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into Config field values, each parsed as its flag would be."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    known = {f.name: f for f in _settings()}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        meta = known[name].metadata
        parse = _flag_bool if meta["parse"] is bool else meta["parse"]
        try:
            if meta["repeatable"] and isinstance(value, list):
                out[name] = tuple(parse_text(parse, item) if isinstance(item, str) else item for item in value)
            else:
                out[name] = parse_text(parse, value) if isinstance(value, str) else value
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: bad value for {key!r}: {exc}") from None
    return out


def build(values: dict[str, Any]) -> Config:
    """A Config from field values, with every field type checked; a repeatable setting's list becomes a tuple."""
    fields = {f.name: f for f in _settings()}
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    # A disk-tier setting without the disk tier would do nothing: say so rather than ignore it.
    idle = [n for n in values if fields[n].metadata["group"] is DISK_TIER and n != "ssd_dir"]
    if idle and not values.get("ssd_dir"):
        flags = ", ".join("--" + n.replace("_", "-") for n in sorted(idle))
        raise ConfigError(f"{flags} {'applies' if len(idle) == 1 else 'apply'} only with --ssd-dir (the disk tier)")
    ready = dict(values)
    for name, value in values.items():
        if fields[name].metadata["repeatable"]:
            ready[name] = (value,) if isinstance(value, str) else tuple(value)
    try:
        return Config(**ready)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
