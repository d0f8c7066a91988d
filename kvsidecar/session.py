"""Engine sessions: identity, layout, mapped memory, and a lease that releases a dead rank's memory."""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvsidecar.errors import Forbidden, OutOfOrder, UnknownSession
from kvsidecar.memory import SessionMemory
from kvsidecar_contract.placement import Geometry, Layout

log = logging.getLogger(__name__)


class Role(enum.Enum):
    """What a session may do."""

    RANK = "rank"  # registers memory, saves, loads, looks up
    SCHEDULER = "scheduler"  # looks up only


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


class SessionRegistry:
    """Open sessions by id; a session not renewed within the TTL is closed and its memory released."""

    def __init__(
        self,
        ttl: float,
        release: Callable[[Session], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self._release = release
        self._clock = clock
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
        """The open sessions, for stats."""
        with self._lock:
            return list(self._sessions.values())
