"""The Sidecar service's handlers, one plain call per method-table row (`kvsidecar_contract.methods`):
`handler(request, call) -> response`, whichever way the call came in.

A handler unpacks (wire), calls the data path, the sessions or tenancy, and replies (wire); the dispatcher
(dispatch.py) runs it as its row says, for the gRPC servicer and the data socket alike. Failures are raised as the
domain's errors and become statuses at one boundary (statuses.py); a batch answers each item's own refusal in its
result. Grants and refusals are tenancy's, not decided here. Adding a method: its row in the table, and one
`@handles` method here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.fence.guard import Listener
from kvsidecar.metrics import Metrics
from kvsidecar.rpc import wire
from kvsidecar.rpc.retention import drop_response, usage_messages
from kvsidecar.rpc.statuses import SESSION_ERRORS, refused
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store import StoreHealth
from kvsidecar.tenancy.live import Tenancy
from kvsidecar.tenancy.table import Caller
from kvsidecar.tenancy.tickets import PeerCred
from kvsidecar.values import LoadArgs, LoadOutcome, SaveArgs, SaveOutcome
from kvsidecar_contract.batches import Batch
from kvsidecar_contract.methods import BY_NAME
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["HANDLERS", "Call", "Handlers", "handles"]

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
    """kvsidecar.v1.Sidecar's handlers over a data path, a session registry and tenancy: one per method-table row,
    whichever way in its call came (the dispatcher runs them)."""

    def __init__(
        self,
        datapath: DataPath,
        sessions: SessionRegistry,
        tenancy: Tenancy,
        metrics: Metrics,
        *,
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
            batch: Batch[SaveArgs, SaveOutcome] = Batch(items).step(
                lambda item: wire.save_args(item.request, session.hash_bytes, groups)
            )
            self.datapath.save_many(session, batch, call.deadline)
        results = self._results("SaveBatch", items, batch, pb.SaveItemResult, wire.save_response)
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
            batch: Batch[LoadArgs, LoadOutcome] = Batch(items).step(
                lambda item: wire.load_args(item.request, session.hash_bytes, groups)
            )
            self.datapath.load_many(session, batch, call.deadline)
        results = self._results("LoadBatch", items, batch, pb.LoadItemResult, wire.load_response)
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

    def _results(
        self,
        method: str,
        items: Sequence[Any],
        batch: Batch[Any, Any],
        result: Callable[..., T],
        response: Callable[[Any], Any],
    ) -> list[T]:
        """Each item's result under its name: its response, or its own refusal (counted and logged as a lone call's).
        An error about the session or the daemon fails the whole batch instead."""
        out = []
        for item, outcome in zip(items, batch.outcomes(), strict=True):
            if not isinstance(outcome, Exception):
                out.append(result(name=item.name, response=response(outcome)))
                continue
            if isinstance(outcome, SESSION_ERRORS):
                raise outcome
            code, reason = refused(self.metrics, method, outcome)
            out.append(result(name=item.name, error=wire.item_error(code, reason)))
        return out


_UNHANDLED = sorted(set(BY_NAME) - set(HANDLERS))
if _UNHANDLED:
    raise AssertionError(f"method-table rows without a handler: {_UNHANDLED}")
