"""The connector's worker side: registers the rank's KV cache, runs the loads and saves the scheduler planned.

Saves and loads never block the forward pass: a step's saves go in one SaveBatch call after its forward and finish
on their own; a step's loads go in one LoadBatch call on a worker thread while vLLM keeps the requests waiting.
Each request's answer is its own: vLLM learns per request which finished and which blocks failed. The one wait is
a fence: before a step writes a block (a new allocation, a copy, a load, recurrent state written in place), every
save still reading that block is waited for, so the daemon never stores bytes vLLM has already overwritten.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_client.batch import LoadItem, SaveItem
from kvsidecar_client.client import SidecarClient
from kvsidecar_client.errors import InvalidRequest, SidecarError
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.memory import segment_of
from kvsidecar_client.results import LoadResult, Registration
from kvsidecar_client.vllm.metadata import KVSidecarMetadata, LoadSpec, SaveSpec
from kvsidecar_client.vllm.regions import head_dim_of, regions_of
from kvsidecar_client.vllm.stats import StatsRecorder

__all__ = ["TransferResults", "WorkerSide"]

log = logging.getLogger("kvsidecar_client.vllm")

_LOAD_THREADS = 2


@dataclass
class TransferResults:
    """What one step reports to vLLM: requests whose saves or loads finished, and loads that failed."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Save:
    req_id: str
    reads: frozenset[int]
    future: concurrent.futures.Future[Any]


class WorkerSide:
    """One engine rank's loads and saves; `block_ids_unique` says whether vLLM can map failed block ids back.

    vLLM takes failed block ids only from single-group caches (block ids repeat across groups otherwise); with
    several groups a failed load is reported by request, and vLLM recomputes that request's whole hit.
    """

    def __init__(
        self,
        client: SidecarClient,
        layers_of_group: Sequence[Sequence[str]],
        num_blocks: int,
        *,
        block_ids_unique: bool,
        wait_timeout: float,
        stats: StatsRecorder | None = None,
    ) -> None:
        self._client = client
        self._stats = stats if stats is not None else StatsRecorder()
        self._layers = [list(layers) for layers in layers_of_group]
        self._num_blocks = num_blocks
        self._block_ids_unique = block_ids_unique
        self._wait_timeout = wait_timeout
        self._cuda = False
        self._lock = threading.Lock()
        self._saves: list[_Save] = []
        self._saves_of: dict[str, list[_Save]] = {}
        self._awaiting_sent: set[str] = set()
        self._loads: dict[str, tuple[LoadSpec, concurrent.futures.Future[set[int]]]] = {}
        self._failed_block_ids: set[int] = set()
        self._last_meta: KVSidecarMetadata | None = None
        self._load_pool = concurrent.futures.ThreadPoolExecutor(_LOAD_THREADS, "kvsidecar-load")
        # On CUDA a save waits for the step's kernels before the daemon reads; one thread keeps saves in order.
        self._cuda_pool = concurrent.futures.ThreadPoolExecutor(1, "kvsidecar-save")

    # ---- registration ----

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> Registration:
        """Register every layer of every session group: group order, then vLLM's layer order, then K before V."""
        tensors, groups, names = regions_of(kv_caches, self._layers, self._num_blocks)
        for name, tensor in zip(names, tensors, strict=True):
            if tensor.device.type == "cpu" and segment_of(tensor) is None:
                raise InvalidRequest(
                    f"layer {name}'s KV cache is ordinary CPU memory, which the kvsidecar daemon cannot map: allocate "
                    "CPU KV caches with kvsidecar_client.shared_tensor(shape, dtype) (GPU caches are shared by CUDA "
                    "IPC without any change)"
                )
        self._cuda = any(t.device.type == "cuda" for t in tensors)
        cuts = self._client.spec.cuts()
        head_dims = [
            head_dim_of(name, t, max(cuts[g][1] if cuts[g][0] > 1 else 1 for g in gs))
            for name, t, gs in zip(names, tensors, groups, strict=True)
        ]
        return self._client.register(tensors, groups, head_dims=head_dims)

    # ---- each step ----

    def ingest(self, meta: KVSidecarMetadata) -> None:
        """Take this step's metadata once (several hooks see the same object)."""
        if meta is self._last_meta:
            return
        self._last_meta = meta
        with self._lock:
            self._awaiting_sent.update(meta.delayed_saves)

    def fence(self, block_ids: frozenset[int]) -> None:
        """Wait for every save still reading one of `block_ids`: the step is about to write them."""
        if not block_ids:
            return
        with self._lock:
            blocking = [s for s in self._saves if not s.future.done() and not s.reads.isdisjoint(block_ids)]
        for save in blocking:
            # Past its deadline the daemon starts no put and removes what it wrote late, so the block is free.
            concurrent.futures.wait([save.future], timeout=self._wait_timeout)

    def start_loads(self, meta: KVSidecarMetadata) -> None:
        """Start this step's loads on a load thread, all of them in one LoadBatch call."""
        self.ingest(meta)
        self.fence(meta.reused_block_ids)
        if not meta.loads:
            return
        event = self._cuda_event()
        futures: dict[str, concurrent.futures.Future[set[int]]] = {}
        for spec in meta.loads:
            future: concurrent.futures.Future[set[int]] = concurrent.futures.Future()
            futures[spec.req_id] = future
            with self._lock:
                self._loads[spec.req_id] = (spec, future)
        self._load_pool.submit(_settle, futures, self._run_loads, meta.loads, event)

    def _run_loads(self, specs: Sequence[LoadSpec], event: Any) -> dict[str, set[int]]:
        """The blocks each request must recompute: its failed blocks, or all it asked for when its load failed."""
        asked = {spec.req_id: {b for group in spec.reads for b in group} for spec in specs}
        failed: dict[str, set[int]] = {}
        for spec in specs:
            if spec.refused:
                log.warning("kvsidecar load for request %s refused, recomputing it: %s", spec.req_id, spec.refused)
                failed[spec.req_id] = asked[spec.req_id]
        todo = [spec for spec in specs if not spec.refused]
        if not todo:
            return failed
        if event is not None:
            event.synchronize()  # blocks zeroed or copied this step are written before the daemon writes them
        items = [LoadItem(s.req_id, s.block_hashes, s.block_ids, s.hit, s.start_tokens, s.retention) for s in todo]
        start = time.monotonic()
        try:
            results: Mapping[str, LoadResult | SidecarError] = self._client.load_batch(items)
        except SidecarError as error:
            results = dict.fromkeys(asked, error)
        self._stats.add(loads=len(todo), load_seconds=time.monotonic() - start)
        for spec in todo:
            result = results[spec.req_id]
            if isinstance(result, SidecarError):
                # Which blocks the daemon wrote is unknown: every block the load asked for is recomputed.
                log.warning("kvsidecar load for request %s failed, recomputing it: %s", spec.req_id, result)
                failed[spec.req_id] = asked[spec.req_id]
                self._stats.add(load_failed_blocks=len(asked[spec.req_id]))
                continue
            failed[spec.req_id] = result.failed_block_ids
            self._stats.add(
                loaded_blocks=result.loaded, loaded_bytes=result.bytes_loaded, load_failed_blocks=len(result.failures)
            )
            if result.failures:
                log.info(
                    "kvsidecar load for request %s: %d blocks failed, recomputing them",
                    spec.req_id,
                    len(failed[spec.req_id]),
                )
        return failed

    def start_saves(self, meta: KVSidecarMetadata) -> None:
        """Send this step's saves in one SaveBatch call; they finish on their own (the fence waits where it must)."""
        self.ingest(meta)
        if not meta.saves:
            return
        event = self._cuda_event()
        futures: dict[str, concurrent.futures.Future[Any]] = {s.req_id: concurrent.futures.Future() for s in meta.saves}
        if event is None:
            self._send_saves(meta.saves, futures)
        else:
            self._cuda_pool.submit(self._send_saves_after, meta.saves, futures, event)
        for spec in meta.saves:
            save = _Save(spec.req_id, spec.reads, futures[spec.req_id])
            with self._lock:
                self._saves.append(save)
                self._saves_of.setdefault(spec.req_id, []).append(save)

    def _send_saves(self, specs: Sequence[SaveSpec], done: Mapping[str, concurrent.futures.Future[Any]]) -> None:
        """One SaveBatch for the specs; each request's `done` completes once the daemon stopped reading its blocks."""
        items = [
            SaveItem(
                s.req_id,
                s.block_hashes,
                s.block_ids,
                s.num_tokens,
                s.saved_tokens,
                s.token_ids,
                s.token_ids_start,
                s.retention,
            )
            for s in specs
        ]
        start = time.monotonic()
        try:
            jobs = self._client.save_batch(items)
        except BaseException as error:
            # Refused before anything was sent: no block is read. A bug still surfaces, with the blocks freed.
            for future in done.values():
                future.set_result(None)
            if not isinstance(error, SidecarError):
                raise
            log.warning("kvsidecar saves of %d requests refused: %s", len(specs), error)
            self._stats.add(saves=len(specs), save_failures=len(specs))
            return
        for req_id, job in jobs.items():
            job.add_done_callback(functools.partial(_save_finished, req_id, done[req_id], self._stats, start))
        for req_id in done.keys() - jobs.keys():
            # No job came back for it (a client bug): nothing reads its blocks that vLLM would ever hear of.
            log.error("kvsidecar save for request %s got no job back; reporting it done", req_id)
            done[req_id].set_result(None)

    def _send_saves_after(
        self, specs: Sequence[SaveSpec], done: Mapping[str, concurrent.futures.Future[Any]], event: Any
    ) -> None:
        try:
            event.synchronize()  # the step's kernels have written the KV the daemon is about to read
        except BaseException:
            for future in done.values():
                future.set_result(None)  # nothing was sent: the daemon reads none of these blocks
            raise
        self._send_saves(specs, done)
        concurrent.futures.wait(list(done.values()))  # one thread keeps the steps' saves in order

    def _cuda_event(self) -> Any:
        if not self._cuda:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def transfer_results(self, finished_req_ids: Iterable[str]) -> TransferResults:
        """Loads done since the last call, and finished requests whose saves are all done."""
        results = TransferResults()
        with self._lock:
            for req_id, (spec, future) in list(self._loads.items()):
                if not future.done():
                    continue
                del self._loads[req_id]
                error = future.exception()
                if error is None:
                    failed = future.result()
                else:  # a bug, not a daemon answer: recompute everything the load was to write
                    log.error("kvsidecar load for request %s crashed", req_id, exc_info=error)
                    failed = {b for group in spec.reads for b in group}
                results.finished_recving.add(req_id)
                if failed:
                    if self._block_ids_unique:
                        results.failed_block_ids.update(failed)
                    else:
                        results.failed_recving.add(req_id)
            for req_id in list(self._awaiting_sent):
                if all(s.future.done() for s in self._saves_of.get(req_id, ())):
                    self._awaiting_sent.discard(req_id)
                    results.finished_sending.add(req_id)
                    self._saves_of.pop(req_id, None)
            for req_id in finished_req_ids:
                if req_id not in self._awaiting_sent and all(s.future.done() for s in self._saves_of.get(req_id, ())):
                    self._saves_of.pop(req_id, None)
            self._saves = [s for s in self._saves if not s.future.done()]
            self._failed_block_ids.update(results.failed_block_ids)
        return results

    def take_stats(self) -> Any:
        """This rank's loads and saves counted since the last call (vLLM's KVConnectorStats), or None."""
        return self._stats.take()

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed, reported once (single-group caches only)."""
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        """Wait for saves in flight (their blocks must not be reused before), then close the session."""
        with self._lock:
            pending = [s.future for s in self._saves]
        concurrent.futures.wait(pending, timeout=self._wait_timeout)
        self._load_pool.shutdown(wait=True)
        self._cuda_pool.shutdown(wait=True)
        self._client.close()


def _save_finished(
    req_id: str, done: concurrent.futures.Future[Any], stats: StatsRecorder, start: float, job: SaveJob
) -> None:
    """Count the save's outcome, then report it done, whatever the outcome: vLLM frees the request's blocks only
    once get_finished reports it, so a report lost here would hold them for ever (a leak of the KV cache)."""
    try:
        seconds = time.monotonic() - start
        try:
            error = job.exception()
        except BaseException as crash:  # not a daemon answer: a client bug, logged; the daemon stopped reading
            log.error("kvsidecar save for request %s crashed", req_id, exc_info=crash)
            stats.add(saves=1, save_failures=1, save_seconds=seconds)
            return
        if error is not None:
            # A failed save is a future cache miss, never a wrong answer: the daemon stopped reading.
            log.warning("kvsidecar save for request %s failed: %s", req_id, error)
            stats.add(saves=1, save_failures=1, save_seconds=seconds)
            return
        r = job.result()
        stats.add(
            saves=1,
            save_seconds=seconds,
            saved_blocks=r.written,
            saved_bytes=r.bytes_written,
            save_skipped_blocks=r.skipped,
            save_failed_blocks=r.failed,
        )
    finally:
        done.set_result(None)


def _settle(
    futures: Mapping[str, concurrent.futures.Future[set[int]]],
    fn: Callable[..., Mapping[str, set[int]]],
    *args: Any,
) -> None:
    """Complete every future from fn's answer; a crash completes them with it (their requests then recompute)."""
    try:
        answer = fn(*args)
    except BaseException as error:
        for future in futures.values():
            future.set_exception(error)
        raise
    for req_id, future in futures.items():
        future.set_result(answer[req_id])
