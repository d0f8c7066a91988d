"""Saves in flight: each sent as a blocking call from a small pool of client threads, completing its job's future.

A gRPC future would start a thread of its own for every call: measured here, +0.1 ms p50 and ~4x the p99 of a save.
"""

from __future__ import annotations

import concurrent.futures
import threading

from kvsidecar_client.batch import chunks, item_outcomes, save_batch_request
from kvsidecar_client.errors import ClientClosed, InvalidRequest, SessionLost, SidecarError
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.results import SaveResult
from kvsidecar_client.session import LiveSession, SessionKeeper, remaining
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["SaveSender"]

# Saves run as blocking calls on this many threads per client (the daemon runs 8 at once by default).
_SAVE_WORKERS = 8

Batch = list[tuple[str, pb.SaveRequest, "concurrent.futures.Future[SaveResult]"]]


class SaveSender:
    """Sends saves (alone or as one SaveBatch), re-sends them once after a lost session, and tracks those in flight."""

    def __init__(self, keeper: SessionKeeper) -> None:
        self._keeper = keeper
        self._pending: set[concurrent.futures.Future[SaveResult]] = set()
        self._pending_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_SAVE_WORKERS, "kvsidecar-save")

    def send(self, request: pb.SaveRequest, deadline: float) -> SaveJob:
        """Send one Save from a save thread."""
        future = self._future()
        try:
            self._pool.submit(self._send_save, request, deadline, future)
        except RuntimeError:  # the pool is shut down: the client closed
            future.set_exception(ClientClosed("the client is closed", method="Save"))
        return SaveJob(future)

    def send_batch(self, requests: dict[str, pb.SaveRequest | InvalidRequest], deadline: float) -> dict[str, SaveJob]:
        """Send the requests in as few SaveBatch calls as the limits allow; a refused one's job fails at once."""
        jobs: dict[str, SaveJob] = {}
        sendable: Batch = []
        for name, request in requests.items():
            future = self._future()
            jobs[name] = SaveJob(future)
            if isinstance(request, InvalidRequest):
                future.set_exception(request)
            else:
                sendable.append((name, request, future))
        for batch in chunks(sendable):
            try:
                self._pool.submit(self._send_save_batch, batch, deadline)
            except RuntimeError:  # the pool is shut down: the client closed
                for _, _, future in batch:
                    future.set_exception(ClientClosed("the client is closed", method="SaveBatch"))
        return jobs

    def pending(self) -> list[concurrent.futures.Future[SaveResult]]:
        """The saves still in flight."""
        with self._pending_lock:
            return list(self._pending)

    def shutdown(self) -> None:
        """Take no more saves (those in flight finish on their threads)."""
        self._pool.shutdown(wait=False)

    def _send_save(
        self, request: pb.SaveRequest, deadline: float, future: concurrent.futures.Future[SaveResult]
    ) -> None:
        # Runs on a save thread; a lost session is re-opened and the save re-sent once, from here.
        session = self._keeper.session
        if session is None:
            self._save_again(request, None, deadline, future)
            return
        request.session_id = session.id
        try:
            response = self._keeper.rpc("Save", request, remaining(deadline, "Save"))
        except SessionLost:
            self._save_again(request, session, deadline, future)
        except Exception as error:
            # A job always completes: the engine waits on it before reusing its blocks.
            future.set_exception(error)
        else:
            future.set_result(SaveResult.from_proto(response))

    def _save_again(
        self,
        request: pb.SaveRequest,
        stale: LiveSession | None,
        deadline: float,
        future: concurrent.futures.Future[SaveResult],
    ) -> None:
        try:
            session = self._keeper.recover(stale, deadline, "Save")
            request.session_id = session.id
            response = self._keeper.rpc("Save", request, remaining(deadline, "Save"))
        except Exception as error:
            # A job always completes: the engine waits on it before reusing its blocks.
            future.set_exception(error)
        else:
            future.set_result(SaveResult.from_proto(response))

    def _send_save_batch(self, batch: Batch, deadline: float) -> None:
        # Runs on a save thread; a lost session is re-opened and the batch re-sent once (SessionKeeper.call).
        names = [name for name, _, _ in batch]
        try:
            response = self._keeper.call("SaveBatch", save_batch_request(batch), remaining(deadline, "SaveBatch"))
            outcomes = item_outcomes("SaveBatch", names, response.results, SaveResult)
        except Exception as error:
            # A job always completes: the engine waits on it before reusing its blocks.
            for _, _, future in batch:
                future.set_exception(error)
            return
        for (_, _, future), outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, SidecarError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)  # type: ignore[arg-type]

    def _future(self) -> concurrent.futures.Future[SaveResult]:
        future: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # running from the start: a save is never cancelled
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._untrack)
        return future

    def _untrack(self, future: concurrent.futures.Future[SaveResult]) -> None:
        with self._pending_lock:
            self._pending.discard(future)
