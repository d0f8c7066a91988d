"""A real vLLM Scheduler and a real worker-side connector, with a stand-in for the model's forward pass.

The forward pass is the one thing that cannot run here (no GPU, no weights): `write_kv` stands in for it and
writes, into every block a step computes, bytes that depend only on the tokens before them. Equal prompts so get
equal KV in any engine, and a test can say exactly which bytes a warm load must bring back.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvsidecar_client import shared_tensor
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.vllm import KVSidecarConnector

BLOCK = 16
NUM_BLOCKS = 96
MAX_MODEL_LEN = 1024
DTYPE = torch.float32

# Layer specs of the layouts under test (vLLM's own spec classes, as a model runner would report them).
FULL = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=DTYPE)
SLIDING = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=DTYPE, sliding_window=32)
MLA = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=DTYPE)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((3, 8), (2, 4, 4)), dtypes=(DTYPE, DTYPE), mamba_cache_mode="align")

LAYOUTS: dict[str, tuple[KVCacheSpec, ...]] = {
    "full": (FULL,),
    "full+mamba": (FULL, MAMBA),
    "mla+mamba": (MLA, MAMBA),
    "full+sliding": (FULL, SLIDING),
}


def kv_cache_config(specs: Sequence[KVCacheSpec], num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One group per spec, two layers per group (vLLM names them by layer)."""
    groups = [
        KVCacheGroupSpec(layer_names=[f"model.layers.{2 * g + i}.mixer" for i in range(2)], kv_cache_spec=spec)
        for g, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(
    model: Path,
    extra: dict[str, Any],
    *,
    recurrent: bool = False,
    chunk: int = 0,
    kv_role: str = "kv_both",
    prefix_match_unit: int | None = None,
) -> VllmConfig:
    """A VllmConfig for the tiny model on CPU with KVSidecarConnector; `chunk` caps a prefill step's tokens."""
    return VllmConfig(
        device_config=DeviceConfig("cpu"),
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN),
        cache_config=CacheConfig(
            block_size=BLOCK,
            enable_prefix_caching=True,
            mamba_cache_mode="align" if recurrent else "none",
            prefix_match_unit=prefix_match_unit,
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=chunk or MAX_MODEL_LEN,
            max_num_seqs=16,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="kvsidecar_client.vllm",
            kv_role=kv_role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
    )


def allocate(config: KVCacheConfig, *, split_kv: bool = False) -> dict[str, Any]:
    """Shared-memory KV caches shaped as vLLM lays them out: [blocks, slots, heads, K|V] per attention layer (or
    [2, blocks, ...] with `split_kv`), [blocks, latent] per MLA layer, a list of state tensors per Mamba layer."""
    caches: dict[str, Any] = {}
    n = config.num_blocks
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, MambaSpec):
                caches[name] = [
                    shared_tensor((n, *shape), dtype) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
                ]
            elif isinstance(spec, MLAAttentionSpec):
                caches[name] = shared_tensor((n, spec.block_size, spec.head_size), spec.dtype)
            elif split_kv:
                caches[name] = shared_tensor((2, n, spec.block_size, spec.num_kv_heads, spec.head_size), spec.dtype)
            else:
                shape = (n, spec.block_size, spec.num_kv_heads, 2 * spec.head_size)
                caches[name] = shared_tensor(shape, spec.dtype)
    return caches


def prefix_values(tokens: Sequence[int]) -> list[float]:
    """v[p]: a number that depends on tokens[0..p] only (what a position's KV depends on)."""
    out, v = [], 0
    for t in tokens:
        v = (v * 31 + t + 1) % 1_000_003
        out.append(float(v))
    return out


def layer_parts(cache: Any) -> list[torch.Tensor]:
    """A layer's cache as tensors with blocks in dim 0."""
    if isinstance(cache, list):
        return cache
    if cache.shape[0] == 2 and cache.dim() == 5:
        return [cache[0], cache[1]]
    return [cache]


@dataclass
class Engine:
    """vLLM's Scheduler plus one worker connector over shared-memory KV caches: one engine of TP size 1."""

    config: VllmConfig
    kv: KVCacheConfig
    scheduler: Scheduler
    worker: KVSidecarConnector
    caches: dict[str, Any]
    block_hasher: Any

    @classmethod
    def start(cls, config: VllmConfig, kv: KVCacheConfig, *, split_kv: bool = False, resolve: bool = False) -> Engine:
        """`resolve`: size blocks and hashes as vLLM's engine core does for hybrid groups of other block sizes
        (resolve_kv_cache_block_sizes, resolve_cache_hit_alignment_tokens); else one block size, BLOCK, for all."""
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        config.cache_config.num_gpu_blocks = kv.num_blocks
        block_size, hash_block_size = BLOCK, None
        if resolve:
            block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
            kv.hash_block_size = hash_block_size
            kv.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kv, config, block_size, hash_block_size)
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv)
        assert isinstance(worker, KVSidecarConnector)
        caches = allocate(kv, split_kv=split_kv)
        worker.register_kv_caches(caches)
        hasher = get_request_block_hasher(scheduler.hash_block_size, hash_fn)
        return cls(config, kv, scheduler, worker, caches, hasher)

    @property
    def connector(self) -> KVSidecarConnector:
        """The scheduler's connector."""
        connector = self.scheduler.connector
        assert isinstance(connector, KVSidecarConnector)
        return connector

    def add(
        self,
        req_id: str,
        prompt: Sequence[int],
        *,
        max_tokens: int = 2,
        cache_salt: str | None = None,
        look_up: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Add a request; with `look_up`, ask the connector about it as vLLM's scheduler does and wait for the
        daemon's answer, so that the next step admits it with its hit (else the answer comes a step or more later).
        `kv_transfer_params` reach the request as vLLM passes them (SamplingParams.extra_args).
        """
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)
        if look_up:
            assert self.connector.get_num_new_matched_tokens(request, 0)[0] is not None or (
                self.connector.wait_for_lookups(60)
            ), f"no answer to {req_id}'s lookup"

    def request(self, req_id: str) -> Request:
        return self.scheduler.requests[req_id]

    def step(self, *, settle: float = 10.0, before_worker: Any = None, answer_lookups: bool = True) -> Any:
        """One engine step: schedule, the worker's hooks around a stand-in forward, then update_from_output.

        Waits up to `settle` seconds for transfers started this step, as a real engine would see them in some
        later step, and (with `answer_lookups`) for the lookups it started, so that the next step has their
        answers. `before_worker(output)` runs between the scheduler's plan and the worker's hooks.
        """
        output = self.scheduler.schedule()
        if before_worker is not None:
            before_worker(output)
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.write_kv(output)
        self.worker.wait_for_save()
        loading = {load.req_id for load in meta.loads}
        kv_output = self._transfer_output(output.finished_req_ids, loading, settle)
        self.worker.clear_connector_metadata()
        self.scheduler.update_from_output(output, self._runner_output(output, kv_output))
        if answer_lookups:
            self.connector.wait_for_lookups(settle)
        return output

    def _transfer_output(self, finished: set[str], loading: set[str], settle: float) -> KVConnectorOutput:
        deadline = time.monotonic() + settle
        sent: set[str] = set()
        received: set[str] = set()
        failed: set[str] = set()
        while True:
            results = self.worker.get_transfer_results(finished)
            sent |= results.finished_sending
            received |= results.finished_recving
            failed |= results.failed_recving
            if loading <= received or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=received or None,
            failed_recving=failed,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
        )

    def _runner_output(self, output: Any, kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.request(req_id)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    # ---- the stand-in forward pass ----

    def write_kv(self, output: Any) -> None:
        """Write the KV of every token this step computes (attention) and the state after them (recurrent)."""
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, count in output.num_scheduled_tokens.items():
            start = starts[req_id]
            tokens = list(self.request(req_id).all_token_ids)
            values = prefix_values(tokens)
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            end = min(start + count, len(tokens))
            for gid, group in enumerate(self.kv.kv_cache_groups):
                size = group.kv_cache_spec.block_size
                for layer, name in enumerate(group.layer_names):
                    for part, tensor in enumerate(layer_parts(self.caches[name])):
                        offset = 1000.0 * layer + 100.0 * part
                        if isinstance(group.kv_cache_spec, MambaSpec):
                            tensor[table[gid][(end - 1) // size]] = values[end - 1] + offset
                        else:
                            for p in range(start, end):
                                tensor[table[gid][p // size], p % size] = values[p] + offset

    def expected_block(self, tokens: Sequence[int], gid: int, index: int, upto: int) -> list[list[torch.Tensor]]:
        """Per layer and part, what block `index` of group `gid` holds once `upto` tokens are computed."""
        group = self.kv.kv_cache_groups[gid]
        values = prefix_values(tokens)
        out = []
        for layer, name in enumerate(group.layer_names):
            parts = []
            for part, tensor in enumerate(layer_parts(self.caches[name])):
                offset = 1000.0 * layer + 100.0 * part
                if isinstance(group.kv_cache_spec, MambaSpec):
                    parts.append(torch.full_like(tensor[0], values[upto - 1] + offset))
                else:
                    slots = torch.tensor([values[p] + offset for p in range(index * BLOCK, (index + 1) * BLOCK)])
                    parts.append(slots.view(-1, *([1] * (tensor.dim() - 2))).expand_as(tensor[0]).clone())
            out.append(parts)
        return out

    def block_bytes(self, gid: int, block_id: int) -> list[list[torch.Tensor]]:
        """Per layer and part, the bytes of one block of group `gid` in this engine's memory."""
        group = self.kv.kv_cache_groups[gid]
        return [[t[block_id].clone() for t in layer_parts(self.caches[name])] for name in group.layer_names]

    def run_until(self, req_id: str, status: RequestStatus | None = None, *, max_steps: int = 200) -> list[Any]:
        """Step until the request reaches `status` (or finishes, when None)."""
        outputs = []
        for _ in range(max_steps):
            request = self.scheduler.requests.get(req_id)
            if request is None or (status is None and request.is_finished()):
                return outputs
            if status is not None and request.status == status:
                return outputs
            outputs.append(self.step())
        raise AssertionError(f"request {req_id} did not reach {status} in {max_steps} steps")

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


class HeldLookups:
    """A daemon that answers the scheduler's lookups only when the test says so: each lookup waits on the client
    thread, before its call to the real daemon, until `release()`. A step that returns while a lookup is held
    did not wait for it: by construction, not by timing."""

    def __init__(self, engine: Engine) -> None:
        self.started = 0  # lookups that reached the daemon's door
        self._gate = threading.Event()
        self._lock = threading.Lock()
        client = engine.connector.client
        lookup = client.lookup

        def held(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.started += 1
            if not self._gate.wait(120):
                raise AssertionError("a held lookup was never released")
            return lookup(*args, **kwargs)

        client.lookup = held  # type: ignore[method-assign]

    def wait_started(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` lookups reached the daemon's door (a client thread may start a lookup a little later)."""
        give_up = time.monotonic() + timeout
        while self.started < count:
            assert time.monotonic() < give_up, f"{self.started} lookups started, expected {count}"
            time.sleep(0.005)

    def release(self) -> None:
        self._gate.set()


class HeldSaves:
    """A daemon whose saves finish only when the test says so: each save the worker sends is carried out at once,
    but the worker learns it is done only after `release()`. Until then vLLM must treat the blocks as still read.

    `release(outcome)` can hand the worker another outcome than the daemon's answer: an exception instance (a
    SidecarError: the save failed; anything else: the client crashed). `wait_reported()` waits until the worker
    has been told of every save released so far (its done callbacks have run), whatever they did.
    """

    def __init__(self, engine: Engine | KVSidecarConnector) -> None:
        self._gate = threading.Event()
        self._outcome: BaseException | None = None
        self._lock = threading.Condition()
        self._held = 0  # saves whose worker callbacks have not run yet
        worker = engine.worker if isinstance(engine, Engine) else engine
        client = worker.client
        save_batch = client.save_batch

        def held(*args: Any, **kwargs: Any) -> Any:
            return {req_id: self._hold(job) for req_id, job in save_batch(*args, **kwargs).items()}

        client.save_batch = held  # type: ignore[method-assign]

    def _hold(self, job: SaveJob) -> SaveJob:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._held += 1

        def finish() -> None:
            try:
                if not self._gate.wait(120):
                    future.set_exception(AssertionError("a held save was never released"))
                    return
                try:
                    result = job.result(120)
                except BaseException as error:  # the save's own error, passed on as the worker would see it
                    future.set_exception(error)
                    return
                if self._outcome is not None:
                    future.set_exception(self._outcome)
                else:
                    future.set_result(result)
            finally:
                # set_result/set_exception return only once the future's callbacks (the worker's) have run.
                with self._lock:
                    self._held -= 1
                    self._lock.notify_all()

        threading.Thread(target=finish, name="held-save", daemon=True).start()
        return SaveJob(future)

    def release(self, outcome: BaseException | None = None) -> None:
        if not self._gate.is_set():
            self._outcome = outcome
        self._gate.set()

    def wait_reported(self, timeout: float = 60.0) -> None:
        """Until every save released so far has reached the worker (its callbacks ran)."""
        assert self._gate.is_set(), "release() the saves first"
        with self._lock:
            assert self._lock.wait_for(lambda: self._held == 0, timeout), f"{self._held} saves never reported"
