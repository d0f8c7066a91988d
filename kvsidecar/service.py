"""The gRPC servicer: unpack, run off the event loop, reply; failures become statuses in one place."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvsidecar import __version__, wire
from kvsidecar.datapath import DataPath
from kvsidecar.errors import BadRequest, Forbidden, OutOfOrder, ShuttingDown, UnknownSession, grpc_status
from kvsidecar.memory import MappingOwners, SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.session import Role, Session, SessionRegistry
from kvsidecar.store import Store, StoreHealth
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


class SidecarService(pb_grpc.SidecarServicer):
    """kvsidecar.v1.Sidecar over a data path, a session registry and two thread pools."""

    def __init__(
        self,
        datapath: DataPath,
        sessions: SessionRegistry,
        metrics: Metrics,
        *,
        workers: int = 8,
        master_address: str = "",
        store_health: Callable[[], StoreHealth] | None = None,
    ) -> None:
        self.datapath = datapath
        self.sessions = sessions
        self.metrics = metrics
        self.master_address = master_address
        self._store_health = store_health or datapath.store.health
        # KeepAlive and Stats answer from this, refreshed by the daemon's housekeeping: asking a slow master on
        # the event loop would stall every tenant's requests.
        self.health = StoreHealth(False, "not checked yet")
        self.owners = MappingOwners()
        self._started = time.monotonic()
        # Lookups are on the scheduler's critical path: they never queue behind a big save or load.
        self._data_pool = ThreadPoolExecutor(workers, thread_name_prefix="kvsidecar-data")
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvsidecar-lookup")
        self._stopping = False

    @property
    def store(self) -> Store:
        """The store behind the data path."""
        return self.datapath.store

    def stop_accepting(self) -> None:
        """New requests are answered UNAVAILABLE from now on."""
        self._stopping = True

    def shutdown_pools(self) -> None:
        """Wait for running store calls to finish."""
        self._data_pool.shutdown(wait=True)
        self._lookup_pool.shutdown(wait=True)

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        def run() -> pb.OpenSessionResponse:
            role, layout, hash_bytes = wire.open_request(request)
            session = self.sessions.open(role, layout, hash_bytes, request.client_name)
            self.metrics.sessions.labels(role.value).inc()
            geo = session.geometry
            log.info(
                "session %s opened: %s %s tp %d/%d pp %d/%d pcp %d/%d dcp %d (%s)",
                session.id[:8],
                role.value,
                layout.model_key,
                layout.parallel.tp_rank,
                layout.parallel.tp_size,
                layout.parallel.pp_rank,
                layout.parallel.pp_size,
                layout.parallel.pcp_rank,
                layout.parallel.pcp_size,
                layout.parallel.dcp_size,
                request.client_name,
            )
            return pb.OpenSessionResponse(
                session_id=session.id,
                lease_ms=int(self.sessions.ttl * 1000),
                hit_alignment_tokens=geo.unit,
                fine_grained_hits=geo.fine_grained,
                groups=[
                    pb.GroupPlacement(
                        replication_factor=g.factor,
                        shard_id=g.shard,
                        keys_per_boundary=g.keys_per_boundary,
                        span_tokens=g.span,
                    )
                    for g in geo.groups
                ],
                daemon_version=__version__,
            )

        return await self._call(context, "OpenSession", self._lookup_pool, run, request)

    async def RegisterMemory(self, request: pb.RegisterMemoryRequest, context: Any) -> pb.RegisterMemoryResponse:
        def run() -> pb.RegisterMemoryResponse:
            with self.sessions.use(request.session_id) as session:
                if session.role is not Role.RANK:
                    raise Forbidden("a scheduler session cannot register memory")
                specs = wire.region_specs(request.regions)
                with session.lock:
                    if session.memory is not None:
                        raise OutOfOrder("memory is already registered for this session (once per session)")
                memory = SessionMemory(specs, len(session.layout.groups))
                try:
                    self.owners.claim(session.id, memory)
                    for m in memory.mappings.values():
                        self.store.register_buffer(m.address, m.size)
                    with session.lock:
                        # A CloseSession may have released the session while its memory was being mapped.
                        if session.closed:
                            raise UnknownSession("the session was closed while its memory was being registered")
                        if session.memory is not None:
                            raise OutOfOrder("memory is already registered for this session (once per session)")
                        session.memory = memory
                except BaseException:
                    self.owners.release(session.id, memory)
                    memory.close(self._unregister_quietly)
                    raise
            self.metrics.regions_bytes.inc(memory.mapped_bytes)
            return pb.RegisterMemoryResponse(mapped_bytes=memory.mapped_bytes, value_bytes=memory.value_bytes)

        return await self._call(context, "RegisterMemory", self._lookup_pool, run, request)

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        def run() -> pb.KeepAliveResponse:
            self.sessions.get(request.session_id)
            return pb.KeepAliveResponse(lease_ms=int(self.sessions.ttl * 1000), store_healthy=self.health.healthy)

        return await self._call(context, "KeepAlive", None, run, request)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        def run() -> pb.CloseSessionResponse:
            self.sessions.close(request.session_id)
            return pb.CloseSessionResponse()

        return await self._call(context, "CloseSession", self._data_pool, run, request)

    async def Save(self, request: pb.SaveRequest, context: Any) -> pb.SaveResponse:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining

        def run() -> pb.SaveResponse:
            with self.sessions.use(request.session_id) as session:
                hashes = wire.hashes(request.block_hashes, session.hash_bytes)
                ids = wire.block_ids(request.block_ids, len(session.layout.groups))
                out = self.datapath.save(session, hashes, ids, request.num_tokens, request.saved_tokens, deadline)
            return pb.SaveResponse(
                written=out.written,
                skipped=out.skipped,
                failed=len(out.failures),
                striped_to_others=out.striped_to_others,
                bytes_written=out.bytes_written,
                failures=wire.failures(out.failures),
                absent=out.absent,
            )

        return await self._call(context, "Save", self._data_pool, run, request)

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            with self.sessions.use(request.session_id) as session:
                hashes = wire.hashes(request.block_hashes, session.hash_bytes)
                out = self.datapath.lookup(session, hashes, request.num_tokens, request.eagle)
            return pb.LookupResponse(
                hit_tokens=out.hit.tokens, tail_boundaries=out.hit.tails, degraded=out.degraded, detail=out.detail
            )

        return await self._call(context, "Lookup", self._lookup_pool, run, request)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:
        def run() -> pb.LoadResponse:
            with self.sessions.use(request.session_id) as session:
                hashes = wire.hashes(request.block_hashes, session.hash_bytes)
                ids = wire.block_ids(request.block_ids, len(session.layout.groups))
                out = self.datapath.load(
                    session, hashes, ids, request.hit_tokens, list(request.tail_boundaries), request.start_tokens
                )
            return pb.LoadResponse(
                loaded=out.loaded, bytes_loaded=out.bytes_loaded, failures=wire.failures(out.failures)
            )

        return await self._call(context, "Load", self._data_pool, run, request)

    async def Reset(self, request: pb.ResetRequest, context: Any) -> pb.ResetResponse:
        def run() -> pb.ResetResponse:
            with self.sessions.use(request.session_id) as session:
                return pb.ResetResponse(removed=self.datapath.reset(session))

        return await self._call(context, "Reset", self._data_pool, run, request)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        def run() -> pb.StatsResponse:
            health = self.health
            now = time.monotonic()
            counters = {
                s.name: s.value
                for metric in self.metrics.registry.collect()
                for s in metric.samples
                if s.name.endswith("_total") and not s.labels
            }
            return pb.StatsResponse(
                daemon_version=__version__,
                uptime_seconds=now - self._started,
                store_healthy=health.healthy,
                store_detail=health.detail,
                master_address=self.master_address,
                sessions=[_session_info(s, now) for s in self.sessions.snapshot()],
                counters=counters,
            )

        return await self._call(context, "Stats", self._lookup_pool, run, request)

    def release(self, session: Session) -> None:
        """Release a closed or expired session's memory (registry callback)."""
        self.metrics.sessions.labels(session.role.value).dec()
        with session.lock:
            session.closed = True
            memory, session.memory = session.memory, None
        if memory is not None:
            self.metrics.regions_bytes.dec(memory.mapped_bytes)
            self.owners.release(session.id, memory)
            memory.close(self._unregister_quietly)

    def _unregister_quietly(self, address: int) -> None:
        # Unregistering is best-effort cleanup of a mapping that is going away anyway; the store may be down.
        try:
            self.store.unregister_buffer(address)
        except Exception as exc:
            log.warning("could not unregister buffer %#x from the store: %s", address, exc)

    def refresh_health(self) -> StoreHealth:
        """Ask the store how it is (blocking; the daemon does it once a second off the event loop)."""
        self.health = self._store_health()
        return self.health

    async def _call(
        self, context: Any, method: str, pool: ThreadPoolExecutor | None, fn: Callable[[], T], request: Any
    ) -> T:
        try:
            if isinstance(request, wire.Undecodable):
                raise BadRequest(str(request))
            if self._stopping:
                raise ShuttingDown("the daemon is shutting down")
            if pool is None:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        except Exception as exc:
            code, reason = grpc_status(exc)
            self.metrics.requests_rejected.labels(method, code.name).inc()
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            else:
                log.debug("%s refused: %s: %s", method, code.name, reason)
            await context.abort(code, reason)
            raise AssertionError("unreachable: context.abort raises") from exc


def _session_info(s: Session, now: float) -> pb.SessionInfo:
    p = s.layout.parallel
    return pb.SessionInfo(
        session_id_prefix=s.id[:8],
        role=wire.ROLE_TO_PB[s.role],
        model=s.layout.model,
        cache_prefix=s.layout.cache_prefix,
        parallel=pb.ParallelLayout(
            tp_size=p.tp_size,
            tp_rank=p.tp_rank,
            pp_size=p.pp_size,
            pp_rank=p.pp_rank,
            pcp_size=p.pcp_size,
            pcp_rank=p.pcp_rank,
            dcp_size=p.dcp_size,
            dcp_rank=p.dcp_rank,
        ),
        mapped_bytes=s.memory.mapped_bytes if s.memory is not None else 0,
        age_seconds=now - s.opened_at,
        client_name=s.client_name,
    )
