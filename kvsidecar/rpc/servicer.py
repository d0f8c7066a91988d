"""The gRPC servicer: unpack (wire), call the data path, the sessions or tenancy off the event loop, reply (wire).

Every method is one `@answered(pool)` call: the decorator is the one boundary where failures become statuses
(statuses.py), counted and raised with context.abort. Grants and refusals are tenancy's, not decided here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import BadRequest, Forbidden, ShuttingDown
from kvsidecar.fence.guard import Listener
from kvsidecar.metrics import Metrics
from kvsidecar.rpc import wire
from kvsidecar.rpc.auth import caller_of
from kvsidecar.rpc.gates import AccountGates
from kvsidecar.rpc.statuses import SESSION_ERRORS, status_of
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import StoreHealth
from kvsidecar.tenancy.live import Tenancy
from kvsidecar_contract import frames
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc

__all__ = ["SidecarService", "answered"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Pool = str  # which pool runs a method's work: "data", "lookup", or "loop" (on the event loop, for trivial work)

Handler = Callable[["SidecarService", Any, Any], Callable[[], T]]


def answered(pool: Pool) -> Callable[[Handler[Any]], Callable[..., Awaitable[Any]]]:
    """Make a servicer method out of `method(self, request, context) -> work`, where work() builds the response.

    The method itself runs on the event loop and only reads what must be read there (the caller, the deadline);
    work() runs in the named pool. Any exception becomes the status statuses.py maps it to, counted per method.
    """

    def wrap(method: Handler[Any]) -> Callable[..., Awaitable[Any]]:
        name = method.__name__

        @functools.wraps(method)
        async def call(self: SidecarService, request: Any, context: Any) -> Any:
            self.metrics.requests.labels(name).inc()
            try:
                if isinstance(request, wire.Undecodable):
                    raise BadRequest(str(request))
                if self._stopping:
                    raise ShuttingDown("the daemon is shutting down")
                work = method(self, request, context)
                if pool == "loop":
                    return work()
                if name.startswith("Lookup"):
                    # One account's lookups hold at most its share of the lookup threads; the rest wait here.
                    async with self._lookup_gates.hold(self.sessions.account_of(request.session_id)):
                        return await asyncio.get_running_loop().run_in_executor(self._pools[pool], work)
                if pool == "data":
                    return await asyncio.get_running_loop().run_in_executor(self._pools[pool], self.in_data_slot, work)
                return await asyncio.get_running_loop().run_in_executor(self._pools[pool], work)
            except Exception as exc:
                code, reason = self.refused(name, exc)
                await context.abort(code, reason)
                raise AssertionError("unreachable: context.abort raises") from exc

        return call

    return wrap


class SidecarService(pb_grpc.SidecarServicer):
    """kvsidecar.v1.Sidecar over a data path, a session registry, tenancy and two thread pools."""

    def __init__(
        self,
        datapath: DataPath,
        sessions: SessionRegistry,
        tenancy: Tenancy,
        metrics: Metrics,
        *,
        workers: int = 8,
        lookup_workers: int = 2,
        lookups_per_account: int = 1,
        master_address: str = "",
        side_socket: bool = False,
        listeners: Callable[[], list[tuple[Listener, int]]] = list,
        gpu: Callable[[], str] = lambda: "off",
    ) -> None:
        """side_socket: whether sessions get a side secret (the daemon serves a side socket); listeners: every
        listener of the daemon with the packets it refused (the fence's report); gpu: the GPU path's state."""
        self.datapath = datapath
        self.sessions = sessions
        self.tenancy = tenancy
        self.metrics = metrics
        self.master_address = master_address
        self._side_socket = side_socket
        self._listeners = listeners
        self._gpu = gpu
        # KeepAlive and Stats answer from this, refreshed by the daemon's housekeeping: asking a slow master on
        # the event loop would stall every tenant's requests.
        self.health = StoreHealth(False, "not checked yet")
        self._started = time.monotonic()
        # Lookups are on the scheduler's critical path: they never queue behind a big save or load.
        self._pools = {
            "data": ThreadPoolExecutor(workers, thread_name_prefix="kvsidecar-data"),
            "lookup": ThreadPoolExecutor(lookup_workers, thread_name_prefix="kvsidecar-lookup"),
        }
        # Lookups over gRPC and over the data socket share these slots: as many as the lookup pool's threads.
        self._lookup_gates = AccountGates(lookups_per_account, lookup_workers)
        # Saves, loads and closes run on at most `workers` threads at once, the data pool's and the data socket's
        # (rpc/datasocket.py) together.
        self._data_slots = threading.BoundedSemaphore(workers)
        self._stopping = False

    def stop_accepting(self) -> None:
        """New requests are answered UNAVAILABLE from now on."""
        self._stopping = True

    def shutdown_pools(self) -> None:
        """Wait for running store calls to finish."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    def in_data_slot(self, work: Callable[[], T]) -> T:
        """Run work holding one of the data slots."""
        with self._data_slots:
            return work()

    def refused(self, method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """A failed call's status and reason, counted per method and logged (INTERNAL with its traceback)."""
        code, reason = status_of(exc)
        self.metrics.requests_rejected.labels(method, code.name).inc()
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=exc)
        else:
            log.debug("%s refused: %s: %s", method, code.name, reason)
        return code, reason

    def answer_frame(self, method: str, body: bytes | bytearray, session_id: str, time_left: float | None) -> Any:
        """One data-socket call (frames.METHODS), run on the calling thread: the response message, or raises what
        the gRPC call would have been refused with (the caller maps it with `refused`).

        The connection is bound to session_id; a request naming another session is refused.
        """
        self.metrics.requests.labels(method).inc()
        self.metrics.data_socket_requests.labels(method).inc()
        if method == "Lookup":
            # Its size is bounded as over gRPC (parsing a million hashes holds the GIL), by the current limit.
            request = wire.lenient(pb.LookupRequest, *wire.lookup_limit(self.datapath.max_lookup_hashes))(body)
        else:
            request = _FRAME_REQUESTS[method](body)
        if isinstance(request, wire.Undecodable):
            raise BadRequest(str(request))
        if request.session_id != session_id:
            raise Forbidden("this data-socket connection is bound to another session: open one per session")
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down")
        work = getattr(type(self), method).__wrapped__(self, request, _FrameContext(time_left))
        if method == "Lookup":
            with self._lookup_gates.hold_blocking(self.sessions.account_of(session_id), time_left):
                return work()
        return self.in_data_slot(work)

    def refresh_health(self) -> StoreHealth:
        """Ask the store how it is (blocking; the daemon does it once a second off the event loop)."""
        self.health = self.datapath.store.health()
        return self.health

    @answered("lookup")
    def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> Callable[[], pb.OpenSessionResponse]:
        caller = caller_of(context, self.tenancy.tickets)

        def work() -> pb.OpenSessionResponse:
            role, layout, hash_bytes = wire.open_request(request)
            grant = self.tenancy.open_session(caller, layout)
            session = self.sessions.open(role, layout, hash_bytes, request.client_name, grant=grant, caller=caller)
            secret = session.side_secret if self._side_socket and caller.uid is not None else b""
            return wire.open_response(session.id, self.sessions.ttl, session.geometry, secret, grant.tenant)

        return work

    @answered("lookup")
    def RegisterMemory(
        self, request: pb.RegisterMemoryRequest, context: Any
    ) -> Callable[[], pb.RegisterMemoryResponse]:
        def work() -> pb.RegisterMemoryResponse:
            regions = wire.regions(request.regions)
            with self.sessions.use(request.session_id) as session:
                memory = self.sessions.attach(session, regions)
            return wire.register_response(memory.mapped_bytes, memory.value_bytes)

        return work

    @answered("loop")
    def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> Callable[[], pb.KeepAliveResponse]:
        def work() -> pb.KeepAliveResponse:
            self.sessions.get(request.session_id)
            return wire.keepalive_response(self.sessions.ttl, self.health.healthy)

        return work

    @answered("data")
    def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> Callable[[], pb.CloseSessionResponse]:
        def work() -> pb.CloseSessionResponse:
            self.sessions.close(request.session_id)
            return wire.close_response()

        return work

    @answered("data")
    def Save(self, request: pb.SaveRequest, context: Any) -> Callable[[], pb.SaveResponse]:
        deadline = _deadline(context)

        def work() -> pb.SaveResponse:
            with self.sessions.use(request.session_id) as session:
                args = wire.save_args(request, session.hash_bytes, len(session.layout.groups))
                out = self.datapath.save(session, args, deadline)
            return wire.save_response(out)

        return work

    @answered("data")
    def SaveBatch(self, request: pb.SaveBatchRequest, context: Any) -> Callable[[], pb.SaveBatchResponse]:
        deadline = _deadline(context)

        def work() -> pb.SaveBatchResponse:
            with self.sessions.use(request.session_id) as session:
                items = wire.batch_items(request.items, "SaveBatch")
                self.metrics.batch_items.labels("SaveBatch").inc(len(items))
                session.require_memory()  # a session that may not save or load fails the batch, whatever its items
                groups = len(session.layout.groups)
                args = [_item(wire.save_args, item, session.hash_bytes, groups) for _, item in items]
                outs = self.datapath.save_many(session, [a for a in args if not isinstance(a, Exception)], deadline)
            results = self._answers("SaveBatch", items, args, outs, pb.SaveItemResult, wire.save_response)
            return pb.SaveBatchResponse(results=results)

        return work

    @answered("lookup")
    def Lookup(self, request: pb.LookupRequest, context: Any) -> Callable[[], pb.LookupResponse]:
        def work() -> pb.LookupResponse:
            with self.sessions.use(request.session_id) as session:
                out = self.datapath.lookup(session, wire.lookup_args(request, session.hash_bytes))
            return wire.lookup_response(out)

        return work

    @answered("data")
    def Load(self, request: pb.LoadRequest, context: Any) -> Callable[[], pb.LoadResponse]:
        def work() -> pb.LoadResponse:
            with self.sessions.use(request.session_id) as session:
                args = wire.load_args(request, session.hash_bytes, len(session.layout.groups))
                out = self.datapath.load(session, args)
            return wire.load_response(out)

        return work

    @answered("data")
    def LoadBatch(self, request: pb.LoadBatchRequest, context: Any) -> Callable[[], pb.LoadBatchResponse]:
        def work() -> pb.LoadBatchResponse:
            with self.sessions.use(request.session_id) as session:
                items = wire.batch_items(request.items, "LoadBatch")
                self.metrics.batch_items.labels("LoadBatch").inc(len(items))
                session.require_memory()  # a session that may not save or load fails the batch, whatever its items
                groups = len(session.layout.groups)
                args = [_item(wire.load_args, item, session.hash_bytes, groups) for _, item in items]
                outs = self.datapath.load_many(session, [a for a in args if not isinstance(a, Exception)])
            results = self._answers("LoadBatch", items, args, outs, pb.LoadItemResult, wire.load_response)
            return pb.LoadBatchResponse(results=results)

        return work

    @answered("data")
    def Reset(self, request: pb.ResetRequest, context: Any) -> Callable[[], pb.ResetResponse]:
        def work() -> pb.ResetResponse:
            with self.sessions.use(request.session_id) as session:
                self.tenancy.check_reset(session.tenant, session.caller, session.layout)
                return wire.reset_response(self.datapath.reset(session))

        return work

    @answered("lookup")
    def Stats(self, request: pb.StatsRequest, context: Any) -> Callable[[], pb.StatsResponse]:
        caller = caller_of(context, self.tenancy.tickets)

        def work() -> pb.StatsResponse:
            scope = self.tenancy.stats_scope(caller)
            summaries = self.sessions.summaries()
            if scope.admin:
                counters = self.metrics.totals()
            else:
                # A tenant sees its own sessions and counters only: others' traffic says what they serve.
                summaries = [s for s in summaries if s.tenant in scope.tenants]
                counters = self.metrics.tenant_totals(set(scope.tenants))
            return wire.stats_response(
                time.monotonic() - self._started,
                self.health,
                self.master_address,
                summaries,
                counters,
                self.tenancy.table.describe(),
                ",".join(sorted(scope.tenants)),
                self._listeners(),
                self._gpu(),
            )

        return work

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
        code, reason = self.refused(method, exc)
        return wire.item_error(code, reason)


class _FrameContext:
    """What a data-socket call's handler reads of its context: the time left."""

    def __init__(self, time_left: float | None) -> None:
        self._time_left = time_left

    def time_remaining(self) -> float | None:
        return self._time_left


_FRAME_REQUESTS: dict[str, Callable[[Any], Any]] = {
    name: wire.lenient(getattr(pb, pb.DESCRIPTOR.services_by_name["Sidecar"].methods_by_name[name].input_type.name))
    for name in frames.METHODS.values()
}


def _deadline(context: Any) -> float | None:
    """The client's deadline on time.monotonic(), if it set one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _item(convert: Callable[..., T], *args: Any) -> T | Exception:
    """A batch item's values, or why it is refused (that item alone)."""
    try:
        return convert(*args)
    except Exception as exc:
        return exc
