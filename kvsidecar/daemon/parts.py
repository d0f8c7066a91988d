"""The daemon's serving parts, each built from its own settings in dependency order: tenancy, then (over the store
and the GPU runtime) sessions with their memories' movers, the data path and the service. No socket, no process:
the daemon binds its listeners around them, and a test builds them over the in-memory store.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsidecar.daemon.settings import ServiceSettings, TenancySettings
from kvsidecar.datapath.retention import Retainer
from kvsidecar.datapath.retries import RetryPolicy
from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import ConfigError, DaemonError
from kvsidecar.events.feed import NO_EVENTS, StoreEvents
from kvsidecar.fence.guard import Listener
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.runtime import GpuRuntime
from kvsidecar.rpc.dispatch import Dispatcher
from kvsidecar.rpc.handlers import Handlers
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import Store
from kvsidecar.tenancy.live import Tenancy
from kvsidecar.tenancy.retention import RetentionLedger
from kvsidecar.tenancy.shares import SessionShares, ShareLimits

__all__ = ["build_data_path", "build_service", "build_sessions", "open_tenancy"]


def open_tenancy(settings: TenancySettings, metrics: Metrics) -> Tenancy:
    """The tenants table (single-tenant without a file) and its live grants; a tenants file that cannot be used
    stops the daemon with the reason."""
    try:
        return Tenancy(
            metrics,
            settings.tenants,
            allow_shm_names=settings.allow_shm_names,
            retained_bytes=settings.retained_bytes,
        )
    except ConfigError as exc:
        raise DaemonError(str(exc)) from None


def build_sessions(
    settings: ServiceSettings, shares: ShareLimits, store: Store, metrics: Metrics, gpu: GpuRuntime
) -> SessionRegistry:
    """The sessions, each memory attached with its mover (over the store, and the GPU path where there is one; its
    values sealed and checked as --checksums says), within the daemon's shares."""
    return SessionRegistry(
        settings.session_ttl,
        Movers(store, metrics, gpu, settings.checksums),
        metrics=metrics,
        shares=SessionShares.of(shares),
    )


def build_data_path(
    settings: ServiceSettings,
    store: Store,
    metrics: Metrics,
    tenancy: Tenancy,
    events: StoreEvents = NO_EVENTS,
    retries: RetryPolicy | None = None,
) -> DataPath:
    """Saves, lookups and loads against the store, within each tenant's write and retention budgets, telling events
    of writes; loads try again what the store failed transiently, as retries allows."""
    ledger = RetentionLedger(tenancy.retention_budget, max_seconds=settings.max_retention_seconds)
    return DataPath(
        store,
        metrics,
        budget_of=tenancy.budget,
        events=events,
        max_lookup_hashes=settings.max_lookup_hashes,
        retries=retries,
        retention=Retainer(
            store,
            ledger,
            metrics,
            lambda s: tenancy.check_operator(s.caller, "a hard pin"),
            settings.checksums.checksum_every,
        ),
    )


def build_service(
    settings: ServiceSettings,
    datapath: DataPath,
    sessions: SessionRegistry,
    tenancy: Tenancy,
    metrics: Metrics,
    gpu: GpuRuntime,
    *,
    master_address: str = "",
    listeners: Callable[[], list[tuple[Listener, int]]] = list,
) -> Dispatcher:
    """The Sidecar service over the data path and the sessions: its handlers, run by the one dispatcher both
    transports (gRPC, data socket) call."""
    handlers = Handlers(
        datapath,
        sessions,
        tenancy,
        metrics,
        master_address=master_address,
        side_socket=True,
        listeners=listeners,
        gpu=gpu.describe,
        gpu_failure=lambda: gpu.failure,
    )
    return Dispatcher(
        handlers,
        metrics,
        workers=settings.workers,
        lookup_workers=settings.lookup_workers,
        lookups_per_account=settings.lookups_per_account,
    )
