"""Saves in flight: each sent as a blocking call from a small pool of client threads, completing its job's future;
a save still waiting for one when the engine waits on its job (SaveJob.result) is sent from the waiting thread.

A gRPC future would start a thread of its own for every call: measured here, +0.1 ms p50 and ~4x the p99 of a save.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from kvsidecar_client.batch import parts, send
from kvsidecar_client.errors import ClientClosed
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.results import SaveResult
from kvsidecar_client.session import SessionKeeper, remaining
from kvsidecar_contract.batches import Batch
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["SaveSender"]

# Saves run as blocking calls on this many threads per client (the daemon runs 8 at once by default).
_SAVE_WORKERS = 8

Future = concurrent.futures.Future[SaveResult]


class SaveSender:
    """Sends saves (alone or as SaveBatch calls), re-sent once after a lost session (SessionKeeper.call), and tracks
    those in flight."""

    def __init__(self, keeper: SessionKeeper) -> None:
        self._keeper = keeper
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_SAVE_WORKERS, "kvsidecar-save")

    def send(self, request: pb.SaveRequest, deadline: float) -> SaveJob:
        """Send one Save from a save thread, or from the thread that waits for it first (SaveJob.result)."""
        future = self._future()
        once = _Once(self._send_save, request, deadline, future)
        self._submit("Save", [future], once)
        return SaveJob(future, once)

    def send_batch(
        self, names: list[str], batch: Batch[pb.SaveItem, SaveResult], deadline: float
    ) -> dict[str, SaveJob]:
        """Send the batch (its items named `names`, in order) from a save thread, in as few SaveBatch calls as the
        limits allow; each job completes with its item's outcome once the calls have returned (an item the client
        refused, with its refusal)."""
        futures = [self._future() for _ in names]
        self._submit("SaveBatch", futures, self._send_batch, batch, futures, deadline)
        return {name: SaveJob(future) for name, future in zip(names, futures, strict=True)}

    def pending(self) -> list[Future]:
        """The saves still in flight."""
        with self._pending_lock:
            return list(self._pending)

    def shutdown(self) -> None:
        """Take no more saves (those in flight finish on their threads)."""
        self._pool.shutdown(wait=False)

    def _submit(self, method: str, futures: list[Future], fn: Callable[..., None], *args: object) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: the client closed
            for future in futures:
                future.set_exception(ClientClosed("the client is closed", method=method))

    def _send_save(self, request: pb.SaveRequest, deadline: float, future: Future) -> None:
        # Runs on a save thread or the waiting caller's (_Once); a lost session is re-opened and the save re-sent
        # once (SessionKeeper.call).
        try:
            response = self._keeper.call("Save", request, remaining(deadline, "Save"))
        except BaseException as error:
            # A job always completes: the engine waits on it before reusing its blocks. On the caller's thread a
            # KeyboardInterrupt completes it too, and goes on up to the caller.
            future.set_exception(error)
            if not isinstance(error, Exception):
                raise
        else:
            future.set_result(SaveResult.from_proto(response))

    def _send_batch(self, batch: Batch[pb.SaveItem, SaveResult], futures: list[Future], deadline: float) -> None:
        # Runs on a save thread; every item of the batch is answered (send), so every job completes.
        for part in parts(batch):
            send(self._keeper, "SaveBatch", part, SaveResult, deadline)
        for future, outcome in zip(futures, batch.outcomes(), strict=True):
            _complete(future, outcome)

    def _future(self) -> Future:
        future: Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # running from the start: a save is never cancelled
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)


class _Once:
    """A call run by whichever thread comes first: a save thread, or the caller waiting for the save."""

    __slots__ = ("_args", "_fn", "_taken")

    def __init__(self, fn: Callable[..., None], *args: object) -> None:
        self._fn, self._args = fn, args
        self._taken = threading.Lock()

    def __call__(self) -> None:
        if self._taken.acquire(blocking=False):
            self._fn(*self._args)


def _complete(future: Future, outcome: SaveResult | Exception) -> None:
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
