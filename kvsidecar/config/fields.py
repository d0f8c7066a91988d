"""Every setting of `kvsidecar serve` as a field, declared once with its default, help, parser and section.

The defaults come from the parts they configure. These are the fields alone; Config (checks.py) is these fields
checked across settings whenever one is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsidecar.config.groups import DISK_TIER, EVENTS, GPU, LIMITS, LOGGING, SOCKETS, STORE, TENANCY, setting
from kvsidecar.daemon.settings import (
    DEFAULT_LOCAL_BUFFER_BYTES,
    DEFAULT_MASTER_TIMEOUT_S,
    DEFAULT_MAX_LOOKUP_HASHES,
    DEFAULT_SEGMENT_BYTES,
)
from kvsidecar.daemon.sockets import DEFAULT_SOCKET_MODE
from kvsidecar.metrics import DEFAULT_METRICS_ADDRESS
from kvsidecar.movers.runtime import GpuSettings
from kvsidecar.parsing import parse_mode, parse_size
from kvsidecar.rpc.servers import DEFAULT_MAX_MESSAGE_BYTES
from kvsidecar.sessions.registry import DEFAULT_SESSION_TTL_S
from kvsidecar.tenancy.shares import (
    DEFAULT_MAX_MEMFDS,
    DEFAULT_MAX_MEMFDS_PER_ACCOUNT,
    DEFAULT_MAX_REGISTERED_BYTES,
    DEFAULT_MAX_REGISTERED_BYTES_PER_ACCOUNT,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SESSIONS_PER_ACCOUNT,
)
from kvsidecar.tiers.node import DEFAULT_BUFFER_BYTES as DEFAULT_SSD_BUFFER_BYTES
from kvsidecar.tiers.node import DEFAULT_SIZE_BYTES as DEFAULT_SSD_BYTES
from kvsidecar_contract.paths import default_socket_path
from kvsidecar_contract.placement import DEFAULT_CHECKSUM_EVERY

__all__ = ["ConfigFields"]

_GPU = GpuSettings()  # the GPU path's own defaults


@dataclass(frozen=True)
class ConfigFields:
    """Everything `kvsidecar serve` can be told: each field is one flag (`--name-with-dashes`) and one config key."""

    socket: str = setting(
        default_factory=default_socket_path,
        help="Unix socket the gRPC service listens on (default: %(default)s)",
        group=SOCKETS,
    )
    socket_mode: int = setting(
        DEFAULT_SOCKET_MODE,
        help="permissions of the socket file, octal (default 0660)",
        parse=parse_mode,
        group=SOCKETS,
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
    checksums: str = setting(
        "sampled",
        help=(
            "end-to-end checksums of stored values, summed at save from the bytes put and checked before a load "
            "answers (a mismatch is a failed block the engine recomputes, counted, never served): sampled (one "
            "value in --checksum-every, chosen by its key), all, or off (none summed, none checked); the rule is "
            "part of every value's id, so daemons of one cluster share values only where their rules agree "
            "(default sampled)"
        ),
        group=STORE,
    )
    checksum_every: int = setting(
        DEFAULT_CHECKSUM_EVERY,
        help=f"with --checksums sampled: one value in this many carries a checksum (default {DEFAULT_CHECKSUM_EVERY})",
        parse=int,
        group=STORE,
    )
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
        _GPU.staging_bytes,
        help=(
            "GPU memory per device the daemon gathers and scatters a batch of blocks in, e.g. 256MiB (default "
            "256MiB); a larger request moves in rounds"
        ),
        parse=parse_size,
        group=GPU,
    )
    gpu_bounce_size: int = setting(
        _GPU.bounce_bytes,
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
    # 16k-token lookups: 181 ms, not 388), and another account keeps half the threads (its p99 while one account
    # floods the lookups: 108 ms, against 192 with 1 of 2): benchmarks/lookup_wait.py --arrivals, lookup_fairness.py.
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
