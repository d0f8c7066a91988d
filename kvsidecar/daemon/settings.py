"""The daemon's settings as each part takes them: small frozen objects cut from Config here, and only here.

Config is every flag of the command line (config.py); a part is told only what it uses, in the settings type it
declares itself (DiskTierSettings beside the disk tier, ServerSettings beside the servers), so a part's settings
say at a glance what it depends on and a test builds one without a Config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsidecar.config import Config
from kvsidecar.fence.daemon import ReportSettings
from kvsidecar.movers.runtime import GpuSettings
from kvsidecar.rpc.auth import TlsSettings
from kvsidecar.rpc.servers import ServerSettings
from kvsidecar.tenancy.shares import ShareLimits
from kvsidecar.tiers.node import DiskTierSettings
from kvsidecar_contract.paths import default_socket_path

__all__ = [
    "EventSettings",
    "MasterSettings",
    "ServiceSettings",
    "Settings",
    "SocketSettings",
    "StoreSettings",
    "TenancySettings",
    "settings_of",
]


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
    """The service's pools and lookup gates, the sessions' lease, and the data path's lookup bound."""

    workers: int
    lookup_workers: int
    lookups_per_account: int
    session_ttl: float
    max_lookup_hashes: int
    max_message_bytes: int
    max_retention_seconds: float = 86400.0


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


def settings_of(config: Config) -> Settings:
    """Each part's settings, cut from the daemon's Config."""
    c = config
    return Settings(
        socket=SocketSettings(c.socket, c.socket_mode, c.socket_group, c.socket == default_socket_path()),
        tenancy=TenancySettings(
            c.tenants,
            c.allow_shm_names,
            c.trust_local_accounts,
            c.segment_size // 2 if c.retained_bytes < 0 else c.retained_bytes,
        ),
        master=MasterSettings(
            c.master,
            c.master_binary,
            c.master_lease_ttl_ms,
            tuple(c.peer_network),
            c.master_timeout,
            math.ceil(c.max_retention_seconds * 1000),
        ),
        store=StoreSettings(
            local_hostname=c.local_hostname,
            metadata_server=c.metadata_server,
            segment_size=c.segment_size,
            local_buffer_size=c.local_buffer_size,
            protocol=c.protocol,
            rdma_devices=c.rdma_devices,
            replicas=c.replicas,
        ),
        disk=DiskTierSettings(c.ssd_dir, c.ssd_size, c.ssd_buffer_size, c.master, c.master_client_ttl, c.segment_size)
        if c.ssd_dir
        else None,
        gpu=GpuSettings(c.gpu, c.gpu_staging_size, c.gpu_bounce_size),
        metrics_address=c.metrics_address,
        events=EventSettings(c.kv_events_endpoint, c.kv_events_replay_endpoint, c.kv_events_topic)
        if c.kv_events_endpoint
        else None,
        shares=ShareLimits(
            max_sessions=c.max_sessions,
            max_sessions_per_account=c.max_sessions_per_account,
            max_memfds=c.max_memfds,
            max_memfds_per_account=c.max_memfds_per_account,
            max_registered_bytes=c.max_registered_bytes,
            max_registered_bytes_per_account=c.max_registered_bytes_per_account,
        ),
        service=ServiceSettings(
            c.workers,
            c.lookup_workers,
            c.lookups_per_account,
            c.session_ttl,
            c.max_lookup_hashes,
            c.max_message_bytes,
            c.max_retention_seconds,
        ),
        servers=ServerSettings(
            socket=c.socket,
            socket_mode=c.socket_mode,
            socket_group=c.socket_group,
            max_message_bytes=c.max_message_bytes,
            max_lookup_hashes=c.max_lookup_hashes,
            listen=c.listen,
            tls=TlsSettings(c.tls_cert, c.tls_key, c.tls_client_ca, c.token_file),
            tenants=bool(c.tenants),
        ),
        report=ReportSettings(c.socket_mode, c.socket_group, c.metrics_address),
    )
