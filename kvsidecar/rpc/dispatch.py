"""The one dispatcher: a call of any method-table row (`kvsidecar_contract.methods`) run as its row says, whichever
way it came in.

A call is parsed (wire), admitted (a parsable request, of the connection's own session, while the daemon serves),
counted, made to wait for its account's gate where its row has one, run holding a data slot where its row is of the
data pool, and answered by its handler (handlers.py). The gRPC servicer awaits `run` (the gate waits on the event
loop, the work runs in the row's pool); the data socket calls `run_here` on the connection's thread (the gate waits
there, bounded by the call's deadline). A refusal is mapped to its status here (`refused`), once for both.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvsidecar.errors import BadRequest, Forbidden, ShuttingDown
from kvsidecar.metrics import Metrics
from kvsidecar.rpc import wire
from kvsidecar.rpc.gates import AccountGates
from kvsidecar.rpc.handlers import HANDLERS, Call, Handlers
from kvsidecar.rpc.statuses import refused
from kvsidecar_contract.methods import Method

__all__ = ["Dispatcher"]


class Dispatcher:
    """Runs the calls of both ways in over one set of handlers, pools, gates and data slots."""

    def __init__(
        self,
        handlers: Handlers,
        metrics: Metrics,
        *,
        workers: int = 8,
        lookup_workers: int = 2,
        lookups_per_account: int = 1,
    ) -> None:
        self.handlers = handlers
        self.metrics = metrics
        # Lookups are on the scheduler's critical path: they never queue behind a big save or load.
        self._pools = {
            "data": ThreadPoolExecutor(workers, thread_name_prefix="kvsidecar-data"),
            "lookup": ThreadPoolExecutor(lookup_workers, thread_name_prefix="kvsidecar-lookup"),
        }
        # Gated calls (lookups) of both ways in share these slots: as many as the lookup pool's threads.
        self.gates = AccountGates(lookups_per_account, lookup_workers)
        # Calls of the data pool run on at most `workers` threads at once, the pool's and the data socket's together.
        self._data_slots = threading.BoundedSemaphore(workers)
        self._stopping = False

    def stop_accepting(self) -> None:
        """New calls are answered UNAVAILABLE from now on."""
        self._stopping = True

    def shutdown(self) -> None:
        """Wait for the calls running in the pools (their store calls) to finish."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    async def run(self, method: Method, body: bytes, call: Call) -> Any:
        """A gRPC call's response: admitted and gated on the event loop, its work run in its row's pool."""
        request, work = self._admit(method, body, call)
        if method.pool == "loop":
            return work()
        loop = asyncio.get_running_loop()
        pool = self._pools[method.pool]
        if not method.gate:
            return await loop.run_in_executor(pool, work)
        # One account's gated calls hold at most its share of the slots; the rest wait here, costing nothing.
        async with self.gates.hold(self._account(request)):
            return await loop.run_in_executor(pool, work)

    def run_here(self, method: Method, body: bytes | bytearray, call: Call, *, bound_to: str) -> Any:
        """A data-socket call's response, run on this thread: only for session bound_to (the connection's); a gated
        call waits for its slot at most until the call's deadline."""
        request, work = self._admit(method, body, call, bound_to)
        if not method.gate:
            return work()
        left = None if call.deadline is None else call.deadline - time.monotonic()
        with self.gates.hold_blocking(self._account(request), left):
            return work()

    def refused(self, method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """A failed call's status and reason, counted per method and logged."""
        return refused(self.metrics, method, exc)

    def _admit(
        self, method: Method, body: bytes | bytearray, call: Call, bound_to: str | None = None
    ) -> tuple[Any, Callable[[], Any]]:
        """The call's request and its work, after the checks every way in makes: a parsable request within its row's
        size limit (the current --max-lookup-hashes), bound_to's own (a data-socket connection's session), a daemon
        still serving. Counted once, whether admitted or not."""
        self.metrics.requests.labels(method.name).inc()
        request = wire.request_parser(method, self.handlers.datapath.max_lookup_hashes)(body)
        if isinstance(request, wire.Undecodable):
            raise BadRequest(str(request))
        if bound_to is not None and request.session_id != bound_to:
            raise Forbidden("this data-socket connection is bound to another session: open one per session")
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down")
        work: Callable[[], Any] = functools.partial(HANDLERS[method.name], self.handlers, request, call)
        if method.pool == "data":
            work = functools.partial(self._in_data_slot, work)
        return request, work

    def _account(self, request: Any) -> str:
        """The account whose gate a call waits at: its session's."""
        return self.handlers.sessions.account_of(request.session_id)

    def _in_data_slot(self, work: Callable[[], Any]) -> Any:
        with self._data_slots:
            return work()
