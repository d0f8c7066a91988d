"""Engine sessions: identity, layout, the memory they attach, and a lease that releases a dead rank's memory."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvsidecar.errors import Forbidden, OutOfOrder, UnknownSession
from kvsidecar.memory import MappingOwners, SessionMemory, region_specs
from kvsidecar.metrics import Metrics
from kvsidecar.value_shapes import ValueShapes
from kvsidecar.values import RegionRequest, Role, SessionSummary
from kvsidecar_contract.placement import Geometry, Layout

__all__ = ["Role", "Session", "SessionRegistry"]

log = logging.getLogger(__name__)


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
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0  # requests running now; a busy session never expires
    closed: bool = False  # set (under `lock`) when the session is released; nothing may attach to it afterwards

    def require_memory(self) -> SessionMemory:
        """The session's memory, for saves and loads."""
        if self.role is not Role.RANK:
            raise Forbidden("a scheduler session has no memory: saves and loads need a rank session")
        if self.memory is None:
            raise OutOfOrder("no memory registered: call RegisterMemory once before Save or Load")
        return self.memory

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
        )


class SessionRegistry:
    """Open sessions by id and the memory they attach; a session not renewed within the TTL is closed and released.

    register / unregister are the store's buffer registration (Store.register_buffer / unregister_buffer).
    """

    def __init__(
        self,
        ttl: float,
        register: Callable[[int, int], None],
        unregister: Callable[[int], None],
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self._register = register
        self._unregister = unregister
        self._metrics = metrics or Metrics()
        self._clock = clock
        self._owners = MappingOwners()
        self._shapes = ValueShapes()
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def open(self, role: Role, layout: Layout, hash_bytes: int, client_name: str) -> Session:
        """Create a session with an unguessable id (it is the credential for the session's memory)."""
        now = self._clock()
        session = Session(
            id=secrets.token_urlsafe(24),
            role=role,
            layout=layout,
            geometry=Geometry.of(layout),
            hash_bytes=hash_bytes,
            client_name=client_name,
            opened_at=now,
            expires_at=now + self.ttl,
        )
        with self._lock:
            self._sessions[session.id] = session
        self._metrics.sessions.labels(role.value).inc()
        p = layout.parallel
        log.info(
            "session %s opened: %s %s tp %d/%d pp %d/%d pcp %d/%d dcp %d (%s)",
            session.id[:8],
            role.value,
            layout.model_key,
            p.tp_rank,
            p.tp_size,
            p.pp_rank,
            p.pp_size,
            p.pcp_rank,
            p.pcp_size,
            p.dcp_size,
            client_name,
        )
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id, its lease renewed."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (session.expires_at < self._clock() and not session.in_flight):
                raise UnknownSession(f"unknown session {session_id[:8]!r}: never opened, closed, or lease expired")
            session.expires_at = self._clock() + self.ttl
            return session

    @contextmanager
    def use(self, session_id: str) -> Iterator[Session]:
        """The live session, held for one request: it cannot expire meanwhile, and its lease renews at the end."""
        session = self.get(session_id)
        with self._lock:
            session.in_flight += 1
        try:
            yield session
        finally:
            with self._lock:
                session.in_flight -= 1
                session.expires_at = self._clock() + self.ttl

    def attach(self, session: Session, regions: Sequence[RegionRequest]) -> SessionMemory:
        """Map a rank's regions, claim them and register them with the store, once per session; all or nothing."""
        if session.role is not Role.RANK:
            raise Forbidden("a scheduler session cannot register memory")
        specs = region_specs(regions)
        with session.lock:
            if session.memory is not None:
                raise OutOfOrder("memory is already registered for this session (once per session)")
        memory = SessionMemory(specs, len(session.layout.groups))
        try:
            self._owners.claim(session.id, memory)
            self._shapes.claim(
                session.id,
                [
                    (geo.prefix, tuple(r.block_bytes for r in regions))
                    for geo, regions in zip(session.geometry.groups, memory.groups, strict=True)
                ],
            )
            for m in memory.mappings.values():
                self._register(m.address, m.size)
            with session.lock:
                # A CloseSession may have released the session while its memory was being mapped.
                if session.closed:
                    raise UnknownSession("the session was closed while its memory was being registered")
                if session.memory is not None:
                    raise OutOfOrder("memory is already registered for this session (once per session)")
                session.memory = memory
        except BaseException:
            self._owners.release(session.id, memory)
            self._shapes.release(session.id)
            memory.close(self._unregister_quietly)
            raise
        self._metrics.regions_bytes.inc(memory.mapped_bytes)
        return memory

    def close(self, session_id: str) -> None:
        """Close a session now and release its memory."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise UnknownSession(f"unknown session {session_id[:8]!r}: never opened, closed, or lease expired")
        self._release(session)

    def expire(self) -> list[Session]:
        """Close every session whose lease ran out; returns them."""
        now = self._clock()
        with self._lock:
            dead = [s for s in self._sessions.values() if s.expires_at < now and not s.in_flight]
            for s in dead:
                del self._sessions[s.id]
        for s in dead:
            log.warning("session %s (%s, %s) expired: releasing its memory", s.id[:8], s.role.value, s.client_name)
            self._release(s)
        return dead

    def close_all(self) -> None:
        """Close every session (daemon shutdown)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self._release(s)

    def snapshot(self) -> list[Session]:
        """The open sessions."""
        with self._lock:
            return list(self._sessions.values())

    def summaries(self) -> list[SessionSummary]:
        """What operators see of the open sessions, for stats."""
        now = self._clock()
        return [s.summary(now) for s in self.snapshot()]

    def _release(self, session: Session) -> None:
        """Mark a session closed and release its memory: unclaimed, unregistered, unmapped."""
        self._metrics.sessions.labels(session.role.value).dec()
        with session.lock:
            session.closed = True
            memory, session.memory = session.memory, None
        if memory is not None:
            self._metrics.regions_bytes.dec(memory.mapped_bytes)
            self._owners.release(session.id, memory)
            self._shapes.release(session.id)
            memory.close(self._unregister_quietly)

    def _unregister_quietly(self, address: int) -> None:
        # Unregistering is best-effort cleanup of a mapping that is going away anyway; the store may be down.
        try:
            self._unregister(address)
        except Exception as exc:
            log.warning("could not unregister buffer %#x from the store: %s", address, exc)
