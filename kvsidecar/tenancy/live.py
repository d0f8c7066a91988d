"""The daemon's live tenancy: the tenants file (reloaded on SIGHUP), write and retention budgets, and every grant and
refusal.

The servicer asks here and only here whether a caller may open a session, reset a prefix, read Stats or act as an
operator, and what rights a session gets; refusals are counted here too (as nano-vllm's scheduler asks its block
manager).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.errors import ConfigError, Forbidden
from kvsidecar.metrics import Metrics
from kvsidecar.tenancy.budget import WriteBudget
from kvsidecar.tenancy.table import SINGLE_TENANT, Caller, TenantTable, parse_tenants
from kvsidecar.tenancy.tickets import Tickets
from kvsidecar_contract.placement import Layout

__all__ = ["NO_TENANT_LABEL", "SINGLE_TENANT", "Grant", "StatsScope", "Tenancy", "load_tenants"]

log = logging.getLogger(__name__)

NO_TENANT_LABEL = "none"  # the tenant label of refusals whose caller is no tenant (keeps the label set bounded)
PERMISSION = "permission"  # the refusal reason label of a right not granted


def load_tenants(path: str) -> TenantTable:
    """The tenants file at path; ConfigError when it cannot be read or used."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from None
    return parse_tenants(text, path)


@dataclass(frozen=True)
class Grant:
    """What a new session may do: the tenant it acts for, and its rights beyond the defaults (all off unless given)."""

    tenant: str
    shm_names: bool = False  # may register /dev/shm names (trusted ranks only)
    max_registered_bytes: int | None = None  # the tenant's own cap on registered host memory (None: the daemon's)


@dataclass(frozen=True)
class StatsScope:
    """What a Stats caller may see: every tenant (admin), or the named tenants' own sessions and counters."""

    admin: bool
    tenants: frozenset[str]


class Tenancy:
    """The current tenant table and each tenant's write budget; swapped whole on reload, read without locks.

    allow_shm_names is the single-tenant daemon's explicit grant of /dev/shm names (--allow-shm-names); with a
    tenants file each tenant's own `shm_names` decides.
    """

    def __init__(
        self,
        metrics: Metrics,
        path: str = "",
        *,
        tickets: Tickets | None = None,
        allow_shm_names: bool = False,
        retained_bytes: int = 0,
    ) -> None:
        """retained_bytes is the single-tenant daemon's retention budget (--retained-bytes); with a tenants file each
        tenant's own `retained_bytes` decides."""
        self.path = path
        self._retained_bytes = retained_bytes
        self.tickets = tickets or Tickets()
        self._metrics = metrics
        self._allow_shm_names = allow_shm_names
        self._lock = threading.Lock()
        self._budgets: dict[str, WriteBudget] = {}
        self.table = load_tenants(path) if path else TenantTable()
        self._sync_budgets()

    def reload(self) -> TenantTable:
        """Read the tenants file again; on error the old table stays and ConfigError says why."""
        if not self.path:
            return self.table
        table = load_tenants(self.path)
        self.table = table
        self._sync_budgets()
        return table

    def open_session(self, caller: Caller, layout: Layout) -> Grant:
        """The grant of a new session for this cache prefix and model, or Forbidden with the reason (counted)."""
        table = self.table
        try:
            tenant = table.grant(caller, layout.cache_prefix, layout.model)
        except Forbidden:
            self._refused(self.label(caller))
            raise
        if table.single:
            return Grant(tenant, shm_names=self._allow_shm_names)
        entry = table.by_name.get(tenant)
        if entry is None:
            return Grant(tenant)
        return Grant(tenant, shm_names=entry.shm_names, max_registered_bytes=entry.max_registered_bytes)

    def check_reset(self, tenant: str, caller: Caller, layout: Layout) -> None:
        """Forbidden unless the session's caller still holds the prefix: a reload may have taken it away."""
        try:
            self.table.grant(caller, layout.cache_prefix, layout.model)
        except Forbidden as exc:
            self._refused(tenant or NO_TENANT_LABEL)
            raise Forbidden(f"Reset refused: {exc}") from None

    def stats_scope(self, caller: Caller) -> StatsScope:
        """What the caller may see in Stats; Forbidden (counted) for a caller that is no tenant of a tenants file."""
        table = self.table
        mine = frozenset(t.name for t in table.of(caller))
        if table.admin(caller):
            return StatsScope(True, mine)
        if not mine:
            self._refused(NO_TENANT_LABEL)
            raise Forbidden(f"Stats: {caller.describe()} is no tenant's credential (tenants file {table.source})")
        return StatsScope(False, mine)

    def check_operator(self, caller: Caller, what: str) -> None:
        """Forbidden (counted) unless the caller holds an operator credential (every peer, single-tenant)."""
        table = self.table
        if not table.operator(caller):
            self._refused(self.label(caller))
            raise Forbidden(
                f"{what}: {caller.describe()} is no operator's credential (operator = true in tenants file "
                f"{table.source})"
            )

    def retention_budget(self, tenant: str) -> int:
        """The bytes a tenant's requests may keep ahead of ordinary cache (docs/retention.md)."""
        table = self.table
        if table.single:
            return self._retained_bytes
        entry = table.by_name.get(tenant)
        return entry.retained_bytes if entry is not None else 0

    def budget(self, tenant: str) -> WriteBudget | None:
        """The tenant's write budget, if it has one."""
        return self._budgets.get(tenant)

    def token_hashes(self) -> list[bytes]:
        """Every tenant's bearer-token hash (for the TCP listener's authentication)."""
        return [h for t in self.table.tenants for h in t.token_hashes]

    def label(self, caller: Caller) -> str:
        """The caller's tenant as a metric label: a name from the file, or NO_TENANT_LABEL."""
        mine = self.table.of(caller)
        return mine[0].name if mine else NO_TENANT_LABEL

    def _refused(self, label: str) -> None:
        self._metrics.tenant_refused.labels(label, PERMISSION).inc()

    def _sync_budgets(self) -> None:
        with self._lock:
            for t in self.table.tenants:
                if t.budget is None:
                    self._budgets.pop(t.name, None)
                elif t.name in self._budgets:
                    self._budgets[t.name].set_limits(t.budget.bytes_per_second, t.budget.burst_bytes)
                else:
                    self._budgets[t.name] = WriteBudget(t.budget.bytes_per_second, t.budget.burst_bytes)
            names = {t.name for t in self.table.tenants}
            for name in list(self._budgets):
                if name not in names:
                    del self._budgets[name]
