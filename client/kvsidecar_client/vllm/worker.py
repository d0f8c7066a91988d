"""The connector's worker side: registers the rank's KV cache, runs the loads and saves the scheduler planned.

Saves and loads never block the forward pass: each Save is sent after the step's forward and finishes on its own;
each Load runs on a worker thread while vLLM keeps the request waiting. The one wait is a fence: before a step
writes a block (a new allocation, a copy, a load, recurrent state written in place), every save still reading
that block is waited for, so the daemon never stores bytes vLLM has already overwritten.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_client.client import SidecarClient
from kvsidecar_client.errors import InvalidRequest, SidecarError
from kvsidecar_client.memory import segment_of
from kvsidecar_client.results import Registration
from kvsidecar_client.vllm.metadata import KVSidecarMetadata, LoadSpec, SaveSpec
from kvsidecar_client.vllm.regions import regions_of

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
    ) -> None:
        self._client = client
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
        return self._client.register(tensors, groups)

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
        """Start every load of this step on the load threads."""
        self.ingest(meta)
        self.fence(meta.reused_block_ids)
        event = self._cuda_event()
        for spec in meta.loads:
            future = self._load_pool.submit(self._run_load, spec, event)
            with self._lock:
                self._loads[spec.req_id] = (spec, future)

    def _run_load(self, spec: LoadSpec, event: Any) -> set[int]:
        asked = {b for group in spec.reads for b in group}
        if spec.refused:
            log.warning("kvsidecar load for request %s refused, recomputing it: %s", spec.req_id, spec.refused)
            return asked
        if event is not None:
            event.synchronize()  # blocks zeroed or copied this step are written before the daemon writes them
        try:
            result = self._client.load_detailed(
                spec.block_hashes, spec.block_ids, spec.hit, start_tokens=spec.start_tokens
            )
        except SidecarError as error:
            # Which blocks the daemon wrote is unknown: every block the load asked for is recomputed.
            log.warning("kvsidecar load for request %s failed, recomputing it: %s", spec.req_id, error)
            return asked
        failed = result.failed_block_ids
        if failed:
            log.info("kvsidecar load for request %s: %d blocks failed, recomputing them", spec.req_id, len(failed))
        return failed

    def start_saves(self, meta: KVSidecarMetadata) -> None:
        """Send this step's saves; they finish on their own (the fence waits for them only where it must)."""
        self.ingest(meta)
        if not meta.saves:
            return
        event = self._cuda_event()
        for spec in meta.saves:
            if event is None:
                future = self._send_save(spec)
            else:
                future = self._cuda_pool.submit(self._send_save_after, spec, event)
            save = _Save(spec.req_id, spec.reads, future)
            with self._lock:
                self._saves.append(save)
                self._saves_of.setdefault(spec.req_id, []).append(save)

    def _send_save(self, spec: SaveSpec) -> concurrent.futures.Future[Any]:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            job = self._client.save(spec.block_hashes, spec.block_ids, spec.num_tokens, saved_tokens=spec.saved_tokens)
        except SidecarError as error:
            log.warning("kvsidecar save for request %s refused: %s", spec.req_id, error)
            done.set_result(None)
            return done

        def finished(_: Any) -> None:
            error = job.exception()
            if error is not None:
                # A failed save is a future cache miss, never a wrong answer: the daemon stopped reading.
                log.warning("kvsidecar save for request %s failed: %s", spec.req_id, error)
            done.set_result(None)

        job.add_done_callback(finished)
        return done

    def _send_save_after(self, spec: SaveSpec, event: Any) -> None:
        event.synchronize()  # the step's kernels have written the KV the daemon is about to read
        self._send_save(spec).result()

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
