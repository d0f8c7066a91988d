"""Open sessions by id: opening with a grant, leases that release a dead rank's memory, attaching memory."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvsidecar.errors import BadRequest, Forbidden, OutOfOrder, UnknownSession
from kvsidecar.memory.mappings import Opener
from kvsidecar.memory.owners import MappingOwners
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import Mover
from kvsidecar.movers.factory import Movers
from kvsidecar.sessions.session import Session
from kvsidecar.sessions.shapes import ValueShapes
from kvsidecar.tenancy.live import Grant
from kvsidecar.tenancy.shares import SessionShares, account_of
from kvsidecar.tenancy.table import SINGLE_TENANT, Caller
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar.values import RegionRequest, Role, SessionSummary
from kvsidecar_contract.limits import MAX_MEMFDS
from kvsidecar_contract.placement import Geometry, Layout

__all__ = ["DEFAULT_SESSION_TTL_S", "SessionRegistry"]

DEFAULT_SESSION_TTL_S = 10.0  # how long a session lives without a KeepAlive (or its liveness connection)

log = logging.getLogger(__name__)


class SessionRegistry:
    """Open sessions by id and the memory they attach; a session not renewed within the TTL is closed and released,
    unless its process holds a liveness connection: then it lives exactly as long as that connection.

    movers gives each attached memory its mover (movers/factory.py): the store's registration of host memory, the
    GPU path's staging for GPU memory (which it refuses without one).
    """

    def __init__(
        self,
        ttl: float,
        movers: Movers,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        shares: SessionShares | None = None,
    ) -> None:
        self.ttl = ttl
        self._movers = movers
        self.shares = shares or SessionShares()
        self._metrics = metrics or Metrics()
        self._clock = clock
        self._owners = MappingOwners()
        self._shapes = ValueShapes()
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def open(
        self,
        role: Role,
        layout: Layout,
        hash_bytes: int,
        client_name: str,
        *,
        grant: Grant | None = None,
        caller: Caller | None = None,
    ) -> Session:
        """Create a session with an unguessable id (it is the credential for the session's memory).

        grant is what tenancy granted it (Tenancy.open_session); without one, single-tenant and no extra rights."""
        grant = grant or Grant(SINGLE_TENANT)
        # Which of its values carry a checksum trailer is the daemon's to say (--checksums), in its keys' value id.
        layout = dataclasses.replace(layout, checksum_every=self._movers.checksum_every)
        tenant = grant.tenant
        caller = caller or Caller()
        account = account_of(tenant, caller.uid, caller.cert_subject)
        self.shares.sessions.take(account, 1)
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
            tenant=tenant,
            caller=caller,
            shm_names=grant.shm_names,
            side_secret=secrets.token_bytes(24),
            account=account,
            max_registered_bytes=grant.max_registered_bytes,
        )
        with self._lock:
            self._sessions[session.id] = session
        self._metrics.sessions.labels(role.value).inc()
        p = layout.parallel
        log.info(
            "session %s opened: %s %s tp %d/%d pp %d/%d pcp %d/%d dcp %d (%s)%s",
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
            f" tenant {tenant}" if tenant else "",
        )
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id, its lease renewed."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (self._lapsed(session, self._clock()) and not session.in_flight):
                raise UnknownSession(f"unknown session {session_id[:8]!r}: never opened, closed, or lease expired")
            session.expires_at = self._clock() + self.ttl
            return session

    def account_of(self, session_id: str) -> str:
        """The account a session draws its shares from ("" for an unknown session: its call will say so)."""
        with self._lock:
            session = self._sessions.get(session_id)
        return session.account if session is not None else ""

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

    def accept_fds(self, session_id: str, secret: str, peer: PeerCred, fds: Sequence[int]) -> int:
        """Keep memfds a rank passed over the side socket for its RegisterMemory; returns how many the session holds.

        Only the process credentials that opened the session, with its side secret, may hand it descriptors.
        """
        session = self.proven(session_id, secret, peer)
        with session.lock:
            if session.closed:
                raise UnknownSession("the session was closed")
            if session.memory is not None:
                raise OutOfOrder("memory is already registered for this session: memfds come before RegisterMemory")
            if len(session.pending_fds) + len(fds) > MAX_MEMFDS:
                raise BadRequest(f"at most {MAX_MEMFDS} memfds per session")
            # Counted until the session closes: parked now, mapped (two descriptors each) after RegisterMemory.
            self.shares.memfds.take(session.account, len(fds))
            session.memfds_counted += len(fds)
            session.pending_fds.extend(fds)
            return len(session.pending_fds)

    def proven(self, session_id: str, secret: str, peer: PeerCred) -> Session:
        """The session, if peer is the uid that opened it (its ticket) and knows its side secret (hex); else raise.

        What the side and data sockets accept instead of gRPC's session id alone: the secret travels only in the
        OpenSession answer, and the kernel vouches for the uid.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        refusal = "unknown session, wrong side secret, or another uid than the one that opened the session"
        if session is None or session.closed:
            raise UnknownSession(refusal)
        try:
            sent = bytes.fromhex(secret)
        except ValueError:
            sent = b""
        same_secret = bool(session.side_secret) and hmac.compare_digest(sent, session.side_secret)
        if not same_secret or session.caller.uid != peer.uid:
            raise Forbidden(refusal)
        return session

    def attach(self, session: Session, regions: Sequence[RegionRequest]) -> SessionMemory:
        """Map a rank's regions, claim them and give them their mover, once per session; all or nothing."""
        if session.role is not Role.RANK:
            raise Forbidden("a scheduler session cannot register memory")
        began = time.monotonic()
        with session.lock:
            if session.memory is not None:
                raise OutOfOrder("memory is already registered for this session (once per session)")
            # The passed memfds are used by this registration or by none: a later one sends its own.
            fds, session.pending_fds = session.pending_fds, []
        try:
            memory = SessionMemory(
                regions,
                len(session.layout.groups),
                Opener(fds, shm_names=session.shm_names, cuda=self._movers.cuda_ordinal),
                [session.layout.value_cut(g) for g in range(len(session.layout.groups))],
            )
        except BaseException:
            self._give_memfds(session, session.memfds_counted)
            raise
        finally:
            _close_fds(fds)
        # The passed memfds the daemon now maps stay counted (two descriptors each) until the session closes.
        self._give_memfds(
            session, session.memfds_counted - sum(m.identity[0] == "memfd" for m in memory.mappings.values())
        )
        counted = 0
        mover: Mover | None = None
        try:
            self._take_bytes(session, memory.host_bytes)
            counted = memory.host_bytes
            try:
                self._owners.claim(session.id, memory)
            except Forbidden:
                # The owner may be a session whose lease ran out before housekeeping released it: a rank that
                # reconnects after its lease expired registers the same memory again. Release the expired, retry.
                if not self.expire():
                    raise
                self._owners.claim(session.id, memory)
            self._shapes.claim(
                session.id,
                [
                    (prefix, shape)
                    for geo, shapes in zip(session.geometry.groups, memory.value_shapes, strict=True)
                    for prefix, shape in zip(geo.own, shapes, strict=True)
                ],
            )
            mover = self._movers.mover(memory)
            with session.lock:
                # A CloseSession may have released the session while its memory was being mapped.
                if session.closed:
                    raise UnknownSession("the session was closed while its memory was being registered")
                if session.memory is not None:
                    raise OutOfOrder("memory is already registered for this session (once per session)")
                session.memory = memory
                session.mover = mover
                session.bytes_counted = counted
        except BaseException:
            self.shares.registered_bytes.give(session.account, counted)
            self._owners.release(session.id, memory)
            self._shapes.release(session.id)
            memory.close(mover.close if mover is not None else _nothing)
            self._give_memfds(session, session.memfds_counted)
            raise
        self._metrics.regions_bytes.inc(memory.mapped_bytes)
        log.info(
            "session %s registered %d region%s: %d MiB of %s memory in %d mapping%s, in %.3f s",
            session.id[:8],
            len(regions),
            "" if len(regions) == 1 else "s",
            memory.mapped_bytes >> 20,
            memory.device or "host",
            len(memory.mappings),
            "" if len(memory.mappings) == 1 else "s",
            time.monotonic() - began,
        )
        return memory

    def _give_memfds(self, session: Session, n: int) -> None:
        with session.lock:
            n = max(0, min(n, session.memfds_counted))
            session.memfds_counted -= n
        self.shares.memfds.give(session.account, n)

    def _take_bytes(self, session: Session, amount: int) -> None:
        limit = session.max_registered_bytes
        where = f"max_registered_bytes of {session.account} in the tenants file" if limit is not None else ""
        self.shares.registered_bytes.take(session.account, amount, limit=limit, limit_setting=where)

    def close(self, session_id: str) -> None:
        """Close a session now and release its memory."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise UnknownSession(f"unknown session {session_id[:8]!r}: never opened, closed, or lease expired")
        self._release(session)

    def hold(self, session: Session) -> None:
        """A liveness connection of the session's process opened: the session stays while it is open."""
        with self._lock:
            session.liveness += 1

    def let_go(self, session: Session) -> None:
        """A liveness connection closed; with the last one the process is gone (it closes them only when it
        exits or dies) and the session is released now, or once its calls in flight end."""
        with self._lock:
            session.liveness -= 1
            if session.liveness or self._sessions.get(session.id) is not session:
                return
            session.gone = True
        self.expire()

    def expire(self) -> list[Session]:
        """Close every session whose lease ran out or whose process is gone; returns them."""
        now = self._clock()
        with self._lock:
            dead = [s for s in self._sessions.values() if self._lapsed(s, now) and not s.in_flight]
            for s in dead:
                del self._sessions[s.id]
        for s in dead:
            why = "its process closed its liveness connection (exited or killed)" if s.gone else "expired"
            log.warning("session %s (%s, %s) %s: releasing its memory", s.id[:8], s.role.value, s.client_name, why)
            self._release(s)
        return dead

    @staticmethod
    def _lapsed(session: Session, now: float) -> bool:
        """Its process is gone, or it holds no liveness connection and its lease ran out."""
        return session.gone or (not session.liveness and session.expires_at < now)

    def close_all(self) -> None:
        """Close every session (daemon shutdown), then what their movers shared."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            self._release(s)
        self._movers.close()

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
            mover, session.mover = session.mover, None
            fds, session.pending_fds = session.pending_fds, []
            memfds, session.memfds_counted = session.memfds_counted, 0
            counted, session.bytes_counted = session.bytes_counted, 0
        _close_fds(fds)
        self.shares.sessions.give(session.account, 1)
        self.shares.memfds.give(session.account, memfds)
        self.shares.registered_bytes.give(session.account, counted)
        if memory is not None:
            self._metrics.regions_bytes.dec(memory.mapped_bytes)
            self._owners.release(session.id, memory)
            self._shapes.release(session.id)
            memory.close(mover.close if mover is not None else _nothing)


def _nothing() -> None:
    pass


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
