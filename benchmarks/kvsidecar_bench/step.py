"""Section "step": one engine step of many small requests, as one batched call against one call per request.

A step of `requests` requests of 1-4 blocks each (the sizes cycle 1, 2, 3, 4) is saved, then loaded back into
other blocks, through the daemon two ways, alternating which goes first every round:

- batched: the connector today, one SaveBatch for the step's saves and one LoadBatch for its loads;
- separate: the connector before, one Save per request (sent at once, on the client's save threads) and one Load
  per request (on the connector's two load threads).

Each timing is the whole step: from the first request sent until every answer is in. Between rounds the store is
cleared (untimed), so every save writes. The first round warms up and is not recorded; the bytes of the last
round's loads are checked against the saved ones.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.machine import process_stats
from kvsidecar_bench.paths import Clock, Timing, model_name
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import BLOCK_TOKENS, EngineMemory, ModelShape, hashes_for
from kvsidecar_bench.stats import Samples, ratio, rotated
from kvsidecar_testing.processes import DaemonProcess

__all__ = ["MODES", "StepPoint", "measure_step", "step_bytes", "steps"]

MODES = ("batched", "separate")
_LOAD_THREADS = 2  # the connector's load threads before batching (vllm/worker.py)


@dataclass
class StepPoint:
    """One shape, one operation: step durations and CPU (client and daemon) of each mode."""

    shape: str
    op: str
    requests: int
    blocks: int
    nbytes: int
    samples: dict[str, Samples] = field(default_factory=lambda: {m: Samples() for m in MODES})
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    verified: bool = False

    def add(self, mode: str, timing: Timing) -> None:
        """Record one step."""
        self.samples[mode].add(timing.wall_s, self.nbytes)
        self.cpu_s[mode] += timing.cpu_s

    @property
    def batched_over_separate(self) -> float:
        """Median step time of the batched call over that of the separate calls (< 1: batching is faster)."""
        return ratio(self.samples["batched"].median_s, self.samples["separate"].median_s)

    @property
    def cpu_batched_over_separate(self) -> float:
        """CPU of the batched steps over that of the separate ones."""
        return ratio(self.cpu_s["batched"], self.cpu_s["separate"])


class _Step:
    """The step's requests: names, hashes, and the blocks each is saved from and loaded into."""

    def __init__(self, shape: ModelShape, tag: str, requests: int) -> None:
        self.names = [f"req-{i}" for i in range(requests)]
        sizes = [1 + i % 4 for i in range(requests)]  # step_bytes counts the same
        self.blocks = sum(sizes)
        starts = [sum(sizes[:i]) for i in range(requests)]
        self.hashes = [hashes_for(f"{tag}/{i}", n) for i, n in enumerate(sizes)]
        self.save_ids = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
        self.load_ids = [[b + self.blocks for b in ids] for ids in self.save_ids]
        self.tokens = [n * BLOCK_TOKENS for n in sizes]
        self.nbytes = self.blocks * shape.value_bytes


def step_bytes(shape: ModelShape, requests: int) -> int:
    """Bytes one step of `requests` stores at once (they must fit the segment)."""
    return sum(1 + i % 4 for i in range(requests)) * shape.value_bytes


def steps(shapes: int, rounds: int) -> int:
    """Progress units of the section."""
    return shapes * (rounds + 1)


def measure_step(
    daemon: DaemonProcess, shapes: Sequence[ModelShape], requests: int, rounds: int, progress: Progress, nonce: str
) -> list[StepPoint]:
    """Per shape, its save and load points, both modes side by side."""
    out: list[StepPoint] = []
    clock = Clock(lambda: process_stats(daemon.pid).cpu_s)
    for shape in shapes:
        step = _Step(shape, f"{nonce}/{shape.name}/step", requests)
        memory = EngineMemory.shared(shape, 2 * step.blocks, seed=3)
        save = StepPoint(shape.name, "save", requests, step.blocks, step.nbytes)
        load = StepPoint(shape.name, "load", requests, step.blocks, step.nbytes)
        with _client(daemon, shape, memory) as client, concurrent.futures.ThreadPoolExecutor(_LOAD_THREADS) as pool:
            hits = None
            for r in range(rounds + 1):  # round 0 warms up and is not recorded
                order = rotated(MODES, r)
                for mode in order:
                    client.reset()
                    _, timing = clock.run(functools.partial(_save, client, step, mode))
                    if r:
                        save.add(mode, timing)
                hits = hits or _hits(client, shape, step)
                for ids in step.load_ids:
                    memory.clear_blocks(ids)
                for mode in order:
                    _, timing = clock.run(functools.partial(_load, client, step, hits, mode, pool))
                    if r:
                        load.add(mode, timing)
                progress.step(f"{shape.name}: a step of {requests} requests, round {r}/{rounds}")
            save.verified = load.verified = all(
                memory.same_blocks(a, b) for a, b in zip(step.save_ids, step.load_ids, strict=True)
            )
            client.reset()
        if not load.verified:
            raise BenchError(f"{shape.name}: a step's loads read bytes that differ from the ones it saved")
        out += [save, load]
    return out


class _client:
    """A rank session on the daemon with `memory` registered; closed on exit."""

    def __init__(self, daemon: DaemonProcess, shape: ModelShape, memory: EngineMemory) -> None:
        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

        self.client = SidecarClient.connect(
            daemon.target,
            model=model_name(shape) + "-step",
            layout=EngineLayout(tp_size=shape.tp_size, tp_rank=shape.tp_rank),
            num_kv_heads=shape.kv_heads,
            hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec(shape.group, BLOCK_TOKENS)],
            client_name="kvsidecar-bench-step",
        )

        try:
            self.client.register(memory.tensors, [(0,)] * len(memory.tensors))
        except BaseException:
            self.client.close()
            raise

    def __enter__(self) -> Any:
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def _save(client: Any, step: _Step, mode: str) -> None:
    from kvsidecar_client import SaveItem

    if mode == "batched":
        items = [
            SaveItem(name, h, [ids], n)
            for name, h, ids, n in zip(step.names, step.hashes, step.save_ids, step.tokens, strict=True)
        ]
        results = [job.result() for job in client.save_batch(items).values()]
    else:
        jobs = [client.save(h, [ids], n) for h, ids, n in zip(step.hashes, step.save_ids, step.tokens, strict=True)]
        results = [job.result() for job in jobs]
    written = sum(r.written for r in results)
    if written != step.blocks or any(r.failed for r in results):
        raise BenchError(f"a {mode} step saved {written} of {step.blocks} blocks")


def _hits(client: Any, shape: ModelShape, step: _Step) -> list[Any]:
    from kvsidecar_client import Hit

    if shape.tp_size > 1:
        # A TP rank's lookup needs every rank's shard; this rank's own blocks are what a full hit reads.
        return [Hit(n, (n,)) for n in step.tokens]
    hits = [client.lookup(h, n + 1) for h, n in zip(step.hashes, step.tokens, strict=True)]
    if [h.hit_tokens for h in hits] != step.tokens:
        raise BenchError("the step's lookups missed blocks it had just saved")
    return hits


def _load(client: Any, step: _Step, hits: list[Any], mode: str, pool: concurrent.futures.Executor) -> None:
    from kvsidecar_client import LoadItem, SidecarError

    if mode == "batched":
        items = [
            LoadItem(name, h, [ids], hit)
            for name, h, ids, hit in zip(step.names, step.hashes, step.load_ids, hits, strict=True)
        ]
        results = list(client.load_batch(items).values())
        errors = [r for r in results if isinstance(r, SidecarError)]
        if errors:
            raise BenchError(f"a batched step's loads failed: {errors[0]}")
    else:
        call: Callable[[Any, Any, Any], Any] = lambda h, ids, hit: client.load_detailed(h, [ids], hit)  # noqa: E731
        results = list(pool.map(call, step.hashes, step.load_ids, hits))
    loaded = sum(r.loaded for r in results)
    if loaded != step.blocks or any(r.failures for r in results):
        raise BenchError(f"a {mode} step loaded {loaded} of {step.blocks} blocks")
