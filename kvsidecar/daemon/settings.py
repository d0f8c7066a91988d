"""What the daemon is told: every part's settings, each a small frozen object, and the daemon's own defaults.

A part is told only what it uses, in the settings type it declares itself (DiskTierSettings beside the disk tier,
ServerSettings beside the servers; the daemon's own parts here), so a part's settings say at a glance what it depends
on and a test builds one without a Config. The command line's Config is cut into them above the daemon
(config/cut.py): the daemon never reads a flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsidecar.fence.daemon import ReportSettings
from kvsidecar.movers.runtime import GpuSettings
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.rpc.servers import ServerSettings
from kvsidecar.tenancy.shares import ShareLimits
from kvsidecar.tiers.node import DiskTierSettings

__all__ = [
    "DEFAULT_LOCAL_BUFFER_BYTES",
    "DEFAULT_MASTER_TIMEOUT_S",
    "DEFAULT_MAX_LOOKUP_HASHES",
    "DEFAULT_SEGMENT_BYTES",
    "EventSettings",
    "MasterSettings",
    "ServiceSettings",
    "Settings",
    "SocketSettings",
    "StoreSettings",
    "TenancySettings",
]

DEFAULT_SEGMENT_BYTES = 1 << 30  # the memory this node gives the Mooncake pool
DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20  # the Mooncake client's transfer buffer
# An unreachable master fails the start this soon (Mooncake's own setup retries it for ~90 s).
DEFAULT_MASTER_TIMEOUT_S = 5.0
DEFAULT_MAX_LOOKUP_HASHES = 1 << 17  # a 2M-token prompt at 16-token blocks; one call's work holds the GIL throughout


@dataclass(frozen=True)
class SocketSettings:
    """The Unix socket engines connect to (the side and data sockets sit beside it), its mode and group, and whether
    its directory is the daemon's own (the default socket's: created if missing)."""

    path: str
    mode: int
    group: str
    own_directory: bool


@dataclass(frozen=True)
class TenancySettings:
    """The tenants file ("": single-tenant), what the node's local accounts may be trusted with, and the single
    tenant's retention budget."""

    tenants: str
    allow_shm_names: bool
    trust_local_accounts: bool
    retained_bytes: int = 0


@dataclass(frozen=True)
class MasterSettings:
    """The Mooncake master: an external one's address ("": embed one, started with binary and lease), and how long
    the start waits for it."""

    address: str
    binary: str
    lease_ttl_ms: int
    peer_networks: tuple[str, ...]
    timeout: float
    max_soft_pin_ms: int = 86_400_000  # the embedded master's --max_kv_soft_pin_ttl


@dataclass(frozen=True)
class StoreSettings:
    """How this daemon's Mooncake client is set up (the master's address comes from MasterSettings or the
    embedded master)."""

    local_hostname: str
    metadata_server: str
    segment_size: int
    local_buffer_size: int
    protocol: str
    rdma_devices: str
    replicas: int


@dataclass(frozen=True)
class EventSettings:
    """The KV-event publisher's endpoints and topic."""

    endpoint: str
    replay_endpoint: str
    topic: str


@dataclass(frozen=True)
class ServiceSettings:
    """The service's pools and lookup gates, the sessions' lease, the data path's lookup bound and its checksums."""

    workers: int
    lookup_workers: int
    lookups_per_account: int
    session_ttl: float
    max_lookup_hashes: int
    max_message_bytes: int
    max_retention_seconds: float = 86400.0
    checksums: ChecksumSettings = field(default_factory=ChecksumSettings)


@dataclass(frozen=True)
class Settings:
    """Every part's settings, cut from one Config."""

    socket: SocketSettings
    tenancy: TenancySettings
    master: MasterSettings
    store: StoreSettings
    disk: DiskTierSettings | None  # None: no disk tier (no --ssd-dir)
    gpu: GpuSettings
    metrics_address: str
    events: EventSettings | None  # None: no KV events
    shares: ShareLimits
    service: ServiceSettings
    servers: ServerSettings
    report: ReportSettings
