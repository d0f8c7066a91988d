"""One engine rank or scheduler talking to the daemon: identity, layout, rights, memory and lease."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvsidecar.errors import Forbidden, OutOfOrder
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.movers.base import Mover
from kvsidecar.tenancy.table import SINGLE_TENANT, Caller
from kvsidecar.values import Role, SessionSummary
from kvsidecar_contract.placement import Geometry, Layout

__all__ = ["Role", "Session"]


@dataclass(eq=False)
class Session:
    """One engine rank or scheduler talking to the daemon."""

    id: str
    role: Role
    layout: Layout
    geometry: Geometry
    hash_bytes: int
    client_name: str
    opened_at: float
    expires_at: float
    memory: SessionMemory | None = None
    mover: Mover | None = None  # how its memory's bytes move (set with memory, at registration)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0  # requests running now; a busy session never expires
    closed: bool = False  # set (under `lock`) when the session is released; nothing may attach to it afterwards
    tenant: str = SINGLE_TENANT
    caller: Caller = field(default_factory=Caller)  # the credentials OpenSession was called with
    shm_names: bool = False  # may register /dev/shm names (trusted ranks only; granted explicitly, never by default)
    side_secret: bytes = b""  # proves side-socket requests for this session
    pending_fds: list[int] = field(default_factory=list)  # memfds passed over the side socket, until RegisterMemory
    account: str = ""  # whose fair shares it draws from (tenancy/shares.py account_of)
    max_registered_bytes: int | None = None  # its tenant's own cap on registered host memory (None: the daemon's)
    memfds_counted: int = 0  # memfds it took from its account's share (given back when it closes)
    bytes_counted: int = 0  # registered host bytes it took from its account's share
    data_connections: int = 0  # data-socket connections bound to it now (changed under `lock`; for operators)
    # Liveness connections open now (changed under the registry's lock): while one is open the process is alive
    # and the session never expires, however long its KeepAlives take; when the last one closes it is `gone`.
    liveness: int = 0
    gone: bool = False  # its process closed its liveness connection (exited or was killed): released at once

    def require_memory(self) -> SessionMemory:
        """The session's memory, for saves and loads."""
        if self.role is not Role.RANK:
            raise Forbidden("a scheduler session has no memory: saves and loads need a rank session")
        if self.memory is None:
            raise OutOfOrder("no memory registered: call RegisterMemory once before Save or Load")
        return self.memory

    def require_mover(self) -> Mover:
        """The mover of the session's memory, for saves and loads."""
        self.require_memory()
        if self.mover is None:
            raise OutOfOrder("no memory registered: call RegisterMemory once before Save or Load")
        return self.mover

    def summary(self, now: float) -> SessionSummary:
        """What operators see of this session at time now."""
        memory = self.memory
        return SessionSummary(
            id_prefix=self.id[:8],
            role=self.role,
            model=self.layout.model,
            cache_prefix=self.layout.cache_prefix,
            parallel=self.layout.parallel,
            mapped_bytes=memory.mapped_bytes if memory is not None else 0,
            age_seconds=now - self.opened_at,
            client_name=self.client_name,
            tenant=self.tenant,
            data_connections=self.data_connections,
        )
