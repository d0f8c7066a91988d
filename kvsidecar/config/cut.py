"""Config cut into each part's settings: the one place where the command line becomes what the parts are told."""

from __future__ import annotations

import math

from kvsidecar.config.checks import Config
from kvsidecar.daemon.settings import (
    EventSettings,
    MasterSettings,
    ServiceSettings,
    Settings,
    SocketSettings,
    StoreSettings,
    TenancySettings,
)
from kvsidecar.fence.daemon import ReportSettings
from kvsidecar.movers.runtime import GpuSettings
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.rpc.auth import TlsSettings
from kvsidecar.rpc.servers import ServerSettings
from kvsidecar.tenancy.shares import ShareLimits
from kvsidecar.tiers.node import DiskTierSettings
from kvsidecar_contract.paths import default_socket_path

__all__ = ["settings_of"]


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
            ChecksumSettings(c.checksums, c.checksum_every),
        ),
        servers=ServerSettings(
            socket=c.socket,
            socket_mode=c.socket_mode,
            socket_group=c.socket_group,
            max_message_bytes=c.max_message_bytes,
            listen=c.listen,
            tls=TlsSettings(c.tls_cert, c.tls_key, c.tls_client_ca, c.token_file),
            tenants=bool(c.tenants),
        ),
        report=ReportSettings(c.socket_mode, c.socket_group, c.metrics_address),
    )
