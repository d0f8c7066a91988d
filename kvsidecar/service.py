"""The gRPC servicer: unpack (wire), call the data path or the sessions off the event loop, reply (wire).

Failures become statuses in one place (statuses.py), raised with context.abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvsidecar import wire
from kvsidecar.datapath import DataPath
from kvsidecar.errors import BadRequest, Forbidden, ShuttingDown
from kvsidecar.metrics import Metrics
from kvsidecar.session import SessionRegistry
from kvsidecar.statuses import SESSION_ERRORS, status_of
from kvsidecar.store import StoreHealth
from kvsidecar.tenancy import Tenancy
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
        tenancy: Tenancy | None = None,
        side_socket: bool = False,
    ) -> None:
        self.datapath = datapath
        self.tenancy = tenancy or Tenancy()
        self._side_socket = side_socket  # whether sessions get a side secret (the daemon serves a side socket)
        self.sessions = sessions
        self.metrics = metrics
        self.master_address = master_address
        self._store_health = store_health or datapath.store.health
        # KeepAlive and Stats answer from this, refreshed by the daemon's housekeeping: asking a slow master on
        # the event loop would stall every tenant's requests.
        self.health = StoreHealth(False, "not checked yet")
        self._started = time.monotonic()
        # Lookups are on the scheduler's critical path: they never queue behind a big save or load.
        self._data_pool = ThreadPoolExecutor(workers, thread_name_prefix="kvsidecar-data")
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvsidecar-lookup")
        self._stopping = False
        # The daemon's listeners and the packets each refused (set by the daemon's fence; none in tests).
        self.listener_report: Callable[[], list[tuple[Any, int]]] = list

    def stop_accepting(self) -> None:
        """New requests are answered UNAVAILABLE from now on."""
        self._stopping = True

    def shutdown_pools(self) -> None:
        """Wait for running store calls to finish."""
        self._data_pool.shutdown(wait=True)
        self._lookup_pool.shutdown(wait=True)

    def refresh_health(self) -> StoreHealth:
        """Ask the store how it is (blocking; the daemon does it once a second off the event loop)."""
        self.health = self._store_health()
        return self.health

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        caller = self.tenancy.caller(context)

        def run() -> pb.OpenSessionResponse:
            role, layout, hash_bytes = wire.open_request(request)
            try:
                tenant = self.tenancy.table.grant(caller, layout.cache_prefix, layout.model)
            except Forbidden:
                self.metrics.tenant_refused.labels(self.tenancy.label(caller), "permission").inc()
                raise
            session = self.sessions.open(
                role,
                layout,
                hash_bytes,
                request.client_name,
                tenant=tenant,
                caller=caller,
                shm_names=self.tenancy.shm_names(tenant),
            )
            secret = session.side_secret if self._side_socket and caller.uid is not None else b""
            return wire.open_response(session.id, self.sessions.ttl, session.geometry, secret, tenant)

        return await self._call(context, "OpenSession", self._lookup_pool, run, request)

    async def RegisterMemory(self, request: pb.RegisterMemoryRequest, context: Any) -> pb.RegisterMemoryResponse:
        def run() -> pb.RegisterMemoryResponse:
            regions = wire.regions(request.regions)
            with self.sessions.use(request.session_id) as session:
                memory = self.sessions.attach(session, regions)
            return wire.register_response(memory.mapped_bytes, memory.value_bytes)

        return await self._call(context, "RegisterMemory", self._lookup_pool, run, request)

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        def run() -> pb.KeepAliveResponse:
            self.sessions.get(request.session_id)
            return wire.keepalive_response(self.sessions.ttl, self.health.healthy)

        return await self._call(context, "KeepAlive", None, run, request)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        def run() -> pb.CloseSessionResponse:
            self.sessions.close(request.session_id)
            return wire.close_response()

        return await self._call(context, "CloseSession", self._data_pool, run, request)

    async def Save(self, request: pb.SaveRequest, context: Any) -> pb.SaveResponse:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining

        def run() -> pb.SaveResponse:
            with self.sessions.use(request.session_id) as session:
                args = wire.save_args(request, session.hash_bytes, len(session.layout.groups))
                out = self.datapath.save(session, *args, deadline)
            return wire.save_response(out)

        return await self._call(context, "Save", self._data_pool, run, request)

    async def SaveBatch(self, request: pb.SaveBatchRequest, context: Any) -> pb.SaveBatchResponse:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining

        def run() -> pb.SaveBatchResponse:
            with self.sessions.use(request.session_id) as session:
                items = wire.batch_items(request.items, "SaveBatch")
                self.metrics.batch_items.labels("SaveBatch").inc(len(items))
                session.require_memory()  # a session that may not save or load fails the batch, whatever its items
                groups = len(session.layout.groups)
                args = [_item(wire.save_args, item, session.hash_bytes, groups) for _, item in items]
                outs = self.datapath.save_many(session, [a for a in args if not isinstance(a, Exception)], deadline)
            results = self._answers("SaveBatch", items, args, outs, pb.SaveItemResult, wire.save_response)
            return pb.SaveBatchResponse(results=results)

        return await self._call(context, "SaveBatch", self._data_pool, run, request)

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            with self.sessions.use(request.session_id) as session:
                hashes = wire.hashes(request.block_hashes, session.hash_bytes)
                out = self.datapath.lookup(session, hashes, request.num_tokens, request.eagle)
            return wire.lookup_response(out)

        return await self._call(context, "Lookup", self._lookup_pool, run, request)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:
        def run() -> pb.LoadResponse:
            with self.sessions.use(request.session_id) as session:
                args = wire.load_args(request, session.hash_bytes, len(session.layout.groups))
                out = self.datapath.load(session, *args)
            return wire.load_response(out)

        return await self._call(context, "Load", self._data_pool, run, request)

    async def LoadBatch(self, request: pb.LoadBatchRequest, context: Any) -> pb.LoadBatchResponse:
        def run() -> pb.LoadBatchResponse:
            with self.sessions.use(request.session_id) as session:
                items = wire.batch_items(request.items, "LoadBatch")
                self.metrics.batch_items.labels("LoadBatch").inc(len(items))
                session.require_memory()  # a session that may not save or load fails the batch, whatever its items
                groups = len(session.layout.groups)
                args = [_item(wire.load_args, item, session.hash_bytes, groups) for _, item in items]
                outs = self.datapath.load_many(session, [a for a in args if not isinstance(a, Exception)])
            results = self._answers("LoadBatch", items, args, outs, pb.LoadItemResult, wire.load_response)
            return pb.LoadBatchResponse(results=results)

        return await self._call(context, "LoadBatch", self._data_pool, run, request)

    async def Reset(self, request: pb.ResetRequest, context: Any) -> pb.ResetResponse:
        def run() -> pb.ResetResponse:
            with self.sessions.use(request.session_id) as session:
                # Rights are asked again: a reloaded tenants file may have taken this prefix from the tenant.
                layout = session.layout
                try:
                    self.tenancy.table.grant(session.caller, layout.cache_prefix, layout.model)
                except Forbidden as exc:
                    self.metrics.tenant_refused.labels(session.tenant or "none", "permission").inc()
                    raise Forbidden(f"Reset refused: {exc}") from None
                return wire.reset_response(self.datapath.reset(session))

        return await self._call(context, "Reset", self._data_pool, run, request)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        caller = self.tenancy.caller(context)

        def run() -> pb.StatsResponse:
            uptime = time.monotonic() - self._started
            table = self.tenancy.table
            summaries = self.sessions.summaries()
            mine = {t.name for t in table.of(caller)}
            if table.admin(caller):
                counters = self.metrics.totals()
            elif not mine:
                self.metrics.tenant_refused.labels("none", "permission").inc()
                raise Forbidden(f"Stats: {caller.describe()} is no tenant's credential (tenants file {table.source})")
            else:
                # A tenant sees its own sessions and counters only: others' traffic says what they serve.
                summaries = [s for s in summaries if s.tenant in mine]
                counters = self.metrics.tenant_totals(mine)
            response = wire.stats_response(
                uptime,
                self.health,
                self.master_address,
                summaries,
                counters,
                table.describe(),
                ",".join(sorted(mine)),
            )
            response.listeners.extend(
                pb.ListenerInfo(role=item.role, address=item.address, allowed=item.allowed, dropped_packets=drops)
                for item, drops in self.listener_report()
            )
            return response

        return await self._call(context, "Stats", self._lookup_pool, run, request)

    def _answers(
        self,
        method: str,
        items: Sequence[tuple[str, Any]],
        args: Sequence[Any],
        outs: Sequence[Any],
        result: Callable[..., T],
        response: Callable[[Any], Any],
    ) -> list[T]:
        """Each item's result under its name: its refusal (args) or the data path's answer (outs, in order)."""
        done = iter(outs)
        answers = []
        for (name, _), arg in zip(items, args, strict=True):
            out = arg if isinstance(arg, Exception) else next(done)
            if isinstance(out, Exception):
                answers.append(result(name=name, error=self._item_error(method, out)))
            else:
                answers.append(result(name=name, response=response(out)))
        return answers

    def _item_error(self, method: str, exc: Exception) -> pb.ItemError:
        """A batch item's own refusal, counted and logged as a lone call's; session errors fail the whole batch."""
        if isinstance(exc, SESSION_ERRORS):
            raise exc
        code, reason = status_of(exc)
        self.metrics.requests_rejected.labels(method, code.name).inc()
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s: an item failed", method, exc_info=exc)
        else:
            log.debug("%s: an item refused: %s: %s", method, code.name, reason)
        return wire.item_error(code, reason)

    async def _call(
        self, context: Any, method: str, pool: ThreadPoolExecutor | None, fn: Callable[[], T], request: Any
    ) -> T:
        self.metrics.requests.labels(method).inc()
        try:
            if isinstance(request, wire.Undecodable):
                raise BadRequest(str(request))
            if self._stopping:
                raise ShuttingDown("the daemon is shutting down")
            if pool is None:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        except Exception as exc:
            code, reason = status_of(exc)
            self.metrics.requests_rejected.labels(method, code.name).inc()
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            else:
                log.debug("%s refused: %s: %s", method, code.name, reason)
            await context.abort(code, reason)
            raise AssertionError("unreachable: context.abort raises") from exc


def _item(convert: Callable[..., T], *args: Any) -> T | Exception:
    """A batch item's values, or why it is refused (that item alone)."""
    try:
        return convert(*args)
    except Exception as exc:
        return exc
