"""The daemon's live tenancy: the tenants file (reloaded on SIGHUP), write budgets, and who a gRPC caller is."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from kvsidecar.budget import WriteBudget
from kvsidecar.config import ConfigError
from kvsidecar.sidechannel import TICKET_METADATA, Tickets
from kvsidecar.tenants import SINGLE_TENANT, Caller, TenantTable, hash_token, parse_tenants

__all__ = ["NO_TENANT_LABEL", "SINGLE_TENANT", "Tenancy", "load_tenants"]

log = logging.getLogger(__name__)

NO_TENANT_LABEL = "none"  # the tenant label of refusals whose caller is no tenant (keeps the label set bounded)


def load_tenants(path: str) -> TenantTable:
    """The tenants file at path; ConfigError when it cannot be read or used."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from None
    return parse_tenants(text, path)


class Tenancy:
    """The current tenant table and each tenant's write budget; swapped whole on reload, read without locks."""

    def __init__(self, path: str = "", tickets: Tickets | None = None) -> None:
        self.path = path
        self.tickets = tickets or Tickets()
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

    def budget(self, tenant: str) -> WriteBudget | None:
        """The tenant's write budget, if it has one."""
        return self._budgets.get(tenant)

    def token_hashes(self) -> list[bytes]:
        """Every tenant's bearer-token hash (for the TCP listener's authentication)."""
        return [h for t in self.table.tenants for h in t.token_hashes]

    def shm_names(self, tenant: str) -> bool:
        """Whether sessions of the tenant may register /dev/shm names (always, single-tenant)."""
        if self.table.single:
            return True
        t = self.table.by_name.get(tenant)
        return t is not None and t.shm_names

    def label(self, caller: Caller) -> str:
        """The caller's tenant as a metric label: a name from the file, or NO_TENANT_LABEL."""
        mine = self.table.of(caller)
        return mine[0].name if mine else NO_TENANT_LABEL

    def caller(self, context: Any) -> Caller:
        """The credentials a call proved: a redeemed side-socket ticket (Unix), or its certificate and token (TCP)."""
        peer: str = context.peer() or ""
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        if peer.startswith("unix:"):
            ticket = metadata.get(TICKET_METADATA)
            cred = self.tickets.redeem(ticket) if isinstance(ticket, str) else None
            if cred is None:
                return Caller(transport="unix")
            return Caller(uid=cred.uid, gids=cred.groups, transport="unix")
        auth = context.auth_context() or {}
        subjects = auth.get("x509_subject") or []
        subject = subjects[0].decode(errors="replace") if subjects else None
        sent = metadata.get("authorization", "")
        token_hash = None
        if isinstance(sent, str) and sent.startswith("Bearer "):
            token_hash = hash_token(sent.removeprefix("Bearer "))
        return Caller(cert_subject=subject, token_hash=token_hash, transport="tcp")

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
