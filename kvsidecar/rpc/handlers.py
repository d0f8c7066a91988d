"""The Sidecar service's handlers, one plain call per method-table row (`kvsidecar_contract.methods`):
`handler(request, call) -> response`, whichever way the call came in.

A handler unpacks (wire), calls the data path, the sessions or tenancy, and replies (wire); it runs in its row's pool
(gRPC, `servicer.py`) or on the data-socket connection's thread (`datasocket.py`), after `admit`. Failures are raised
as the domain's errors; each transport turns them into a status at its one boundary (statuses.py via `refused`).
Grants and refusals are tenancy's, not decided here. Adding a method: its row in the table, and one `@handles`
method here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.errors import BadRequest, Forbidden, ShuttingDown
from kvsidecar.fence.guard import Listener
from kvsidecar.metrics import Metrics
from kvsidecar.rpc import wire
from kvsidecar.rpc.gates import AccountGates
from kvsidecar.rpc.retention import drop_response, usage_messages
from kvsidecar.rpc.statuses import SESSION_ERRORS, status_of
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import StoreHealth
from kvsidecar.tenancy.live import Tenancy
from kvsidecar.tenancy.table import Caller
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar_contract.methods import BY_NAME, Method
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["HANDLERS", "Call", "Handlers", "handles"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Handler = Callable[["Handlers", Any, "Call"], Any]

HANDLERS: dict[str, Handler] = {}  # method name -> its handler; every row of the method table has one


def handles(name: str) -> Callable[[Handler], Handler]:
    """Make a method of Handlers the handler of the method-table row `name`."""
    if name not in BY_NAME:
        raise AssertionError(f"{name} is no row of kvsidecar_contract.methods")

    def register(handler: Handler) -> Handler:
        HANDLERS[name] = handler
        return handler

    return register


@dataclass(frozen=True)
class Call:
    """What a handler knows of its call beside the request: its deadline, and who sent it.

    caller() reads the credentials the call proved (a ticket is redeemed then, once): only handlers that decide by
    the caller ask for it.
    """

    deadline: float | None  # on time.monotonic(); None: the client set none
    credentials: Callable[[], Caller]

    def caller(self) -> Caller:
        return self.credentials()

    @staticmethod
    def of_peer(peer: PeerCred | None, time_left: float | None) -> Call:
        """A call on a Unix connection whose peer the kernel proved (SO_PEERCRED); None: no credential."""
        deadline = None if time_left is None else time.monotonic() + time_left
        if peer is None:
            return Call(deadline, Caller)
        return Call(deadline, lambda: Caller(uid=peer.uid, gids=peer.groups, transport="unix"))


class Handlers:
    """kvsidecar.v1.Sidecar's handlers over a data path, a session registry, tenancy, two thread pools and the
    slots both ways in share."""

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
        gpu_failure: Callable[[], str] = lambda: "",
    ) -> None:
        """side_socket: whether sessions get a side secret (the daemon serves a side socket); listeners: every
        listener of the daemon with the packets it refused (the fence's report); gpu: the GPU path's state, and
        gpu_failure why it failed ("" while it has not)."""
        self.datapath = datapath
        self.sessions = sessions
        self.tenancy = tenancy
        self.metrics = metrics
        self.master_address = master_address
        self._side_socket = side_socket
        self._listeners = listeners
        self._gpu = gpu
        self._gpu_failure = gpu_failure
        # KeepAlive and Stats answer from this, refreshed by the daemon's housekeeping: asking a slow master on
        # the event loop would stall every tenant's requests.
        self.health = StoreHealth(False, "not checked yet")
        self._started = time.monotonic()
        # Lookups are on the scheduler's critical path: they never queue behind a big save or load.
        self._pools = {
            "data": ThreadPoolExecutor(workers, thread_name_prefix="kvsidecar-data"),
            "lookup": ThreadPoolExecutor(lookup_workers, thread_name_prefix="kvsidecar-lookup"),
        }
        # Gated calls (lookups) over gRPC and over the data socket share these slots: as many as the lookup pool's
        # threads.
        self._lookup_gates = AccountGates(lookups_per_account, lookup_workers)
        # Calls of the data pool run on at most `workers` threads at once, the data pool's and the data socket's
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

    def admit(self, method: Method, request: Any, call: Call, bound_to: str | None = None) -> Callable[[], Any]:
        """The call's work, after the checks every way in makes: a parsable request (bound_to: of that session
        alone), a daemon still serving."""
        if isinstance(request, wire.Undecodable):
            raise BadRequest(str(request))
        if bound_to is not None and request.session_id != bound_to:
            raise Forbidden("this data-socket connection is bound to another session: open one per session")
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down")
        handler = HANDLERS[method.name]
        return lambda: handler(self, request, call)

    def answer_frame(
        self,
        method: str,
        body: bytes | bytearray,
        session_id: str,
        time_left: float | None,
        peer: PeerCred | None = None,
    ) -> Any:
        """One data-socket call, run on the calling thread: the response message, or raises what the gRPC call
        would have been refused with (the caller maps it with `refused`).

        The connection is bound to session_id; a request naming another session is refused. A gated call waits for
        its account's slot at most time_left; a call of the data pool holds one of the data slots.
        """
        row = BY_NAME[method]
        self.metrics.requests.labels(method).inc()
        self.metrics.data_socket_requests.labels(method).inc()
        # Sizes are bounded as over gRPC, by the current limits.
        request = wire.request_parser(row, self.datapath.max_lookup_hashes)(body)
        work = self.admit(row, request, Call.of_peer(peer, time_left), bound_to=session_id)
        if row.gate:
            with self._lookup_gates.hold_blocking(self.sessions.account_of(session_id), time_left):
                return self.in_data_slot(work) if row.pool == "data" else work()
        return self.in_data_slot(work) if row.pool == "data" else work()

    def refresh_health(self) -> StoreHealth:
        """Ask the store how it is (blocking; the daemon does it once a second off the event loop)."""
        self.health = self.datapath.store.health()
        return self.health

    @handles("OpenSession")
    def open_session(self, request: pb.OpenSessionRequest, call: Call) -> pb.OpenSessionResponse:
        caller = call.caller()
        role, layout, hash_bytes = wire.open_request(request)
        grant = self.tenancy.open_session(caller, layout)
        session = self.sessions.open(role, layout, hash_bytes, request.client_name, grant=grant, caller=caller)
        secret = session.side_secret if self._side_socket and caller.uid is not None else b""
        return wire.open_response(session.id, self.sessions.ttl, session.geometry, secret, grant.tenant)

    @handles("RegisterMemory")
    def register_memory(self, request: pb.RegisterMemoryRequest, call: Call) -> pb.RegisterMemoryResponse:
        regions = wire.regions(request.regions)
        with self.sessions.use(request.session_id) as session:
            memory = self.sessions.attach(session, regions)
        return wire.register_response(memory.mapped_bytes, memory.value_bytes)

    @handles("KeepAlive")
    def keep_alive(self, request: pb.KeepAliveRequest, call: Call) -> pb.KeepAliveResponse:
        self.sessions.get(request.session_id)
        return wire.keepalive_response(self.sessions.ttl, self.health.healthy)

    @handles("CloseSession")
    def close_session(self, request: pb.CloseSessionRequest, call: Call) -> pb.CloseSessionResponse:
        self.sessions.close(request.session_id)
        return wire.close_response()

    @handles("Save")
    def save(self, request: pb.SaveRequest, call: Call) -> pb.SaveResponse:
        with self.sessions.use(request.session_id) as session:
            args = wire.save_args(request, session.hash_bytes, len(session.layout.groups))
            out = self.datapath.save(session, args, call.deadline)
        return wire.save_response(out)

    @handles("SaveBatch")
    def save_batch(self, request: pb.SaveBatchRequest, call: Call) -> pb.SaveBatchResponse:
        with self.sessions.use(request.session_id) as session:
            items = wire.batch_items(request.items, "SaveBatch")
            self.metrics.batch_items.labels("SaveBatch").inc(len(items))
            session.require_memory()  # a session that may not save or load fails the batch, whatever its items
            groups = len(session.layout.groups)
            args = [_item(wire.save_args, item, session.hash_bytes, groups) for _, item in items]
            outs = self.datapath.save_many(session, [a for a in args if not isinstance(a, Exception)], call.deadline)
        results = self._answers("SaveBatch", items, args, outs, pb.SaveItemResult, wire.save_response)
        return pb.SaveBatchResponse(results=results)

    @handles("Lookup")
    def lookup(self, request: pb.LookupRequest, call: Call) -> pb.LookupResponse:
        with self.sessions.use(request.session_id) as session:
            out = self.datapath.lookup(session, wire.lookup_args(request, session.hash_bytes))
        return wire.lookup_response(out)

    @handles("Load")
    def load(self, request: pb.LoadRequest, call: Call) -> pb.LoadResponse:
        with self.sessions.use(request.session_id) as session:
            args = wire.load_args(request, session.hash_bytes, len(session.layout.groups))
            out = self.datapath.load(session, args, call.deadline)
        return wire.load_response(out)

    @handles("LoadBatch")
    def load_batch(self, request: pb.LoadBatchRequest, call: Call) -> pb.LoadBatchResponse:
        with self.sessions.use(request.session_id) as session:
            items = wire.batch_items(request.items, "LoadBatch")
            self.metrics.batch_items.labels("LoadBatch").inc(len(items))
            session.require_memory()  # a session that may not save or load fails the batch, whatever its items
            groups = len(session.layout.groups)
            args = [_item(wire.load_args, item, session.hash_bytes, groups) for _, item in items]
            outs = self.datapath.load_many(session, [a for a in args if not isinstance(a, Exception)], call.deadline)
        results = self._answers("LoadBatch", items, args, outs, pb.LoadItemResult, wire.load_response)
        return pb.LoadBatchResponse(results=results)

    @handles("Reset")
    def reset(self, request: pb.ResetRequest, call: Call) -> pb.ResetResponse:
        with self.sessions.use(request.session_id) as session:
            self.tenancy.check_reset(session.tenant, session.caller, session.layout)
            return wire.reset_response(self.datapath.reset(session))

    @handles("Stats")
    def stats(self, request: pb.StatsRequest, call: Call) -> pb.StatsResponse:
        scope = self.tenancy.stats_scope(call.caller())
        summaries = self.sessions.summaries()
        if scope.admin:
            counters = self.metrics.totals()
        else:
            # A tenant sees its own sessions and counters only: others' traffic says what they serve.
            summaries = [s for s in summaries if s.tenant in scope.tenants]
            counters = self.metrics.tenant_totals(set(scope.tenants))
        # Retention per tenant it may see: every tenant of the file (or the single tenant "") for an admin.
        retaining = set(self.tenancy.table.tenant_names() or [""]) if scope.admin else set(scope.tenants)
        response = wire.stats_response(
            time.monotonic() - self._started,
            self.health,
            self.master_address,
            summaries,
            counters,
            self.tenancy.table.describe(),
            ",".join(sorted(scope.tenants)),
            self._listeners(),
            self._gpu(),
            self._gpu_failure(),
        )
        retention = self.datapath.retention
        response.retention.extend(usage_messages(retaining, retention.usage(), retention.ledger.budget))
        return response

    @handles("DropRetention")
    def drop_retention(self, request: pb.DropRetentionRequest, call: Call) -> pb.DropRetentionResponse:
        self.tenancy.check_operator(call.caller(), "DropRetention")
        return drop_response(self.datapath.retention.drop(request.tenant))

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


_UNHANDLED = sorted(set(BY_NAME) - set(HANDLERS))
if _UNHANDLED:
    raise AssertionError(f"method-table rows without a handler: {_UNHANDLED}")


def _item(convert: Callable[..., T], *args: Any) -> T | Exception:
    """A batch item's values, or why it is refused (that item alone)."""
    try:
        return convert(*args)
    except Exception as exc:
        return exc
