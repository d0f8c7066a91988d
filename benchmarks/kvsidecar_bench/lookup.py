"""Section 2: lookup latency through the daemon against Mooncake's raw batch existence check of the same keys.

Layout: T=8, H=8, groups [mla, full_attention, mamba], 16-token blocks: 17 namespaces per boundary. Eight rank
sessions first save the blocks of a case through the daemon (tiny values: a lookup only asks whether keys exist):
every block (a full hit) at every length, and at the longest length also the first 10% (a 10% hit) and none (a
miss). Then three things take turns: a scheduler session's Lookup; the same staged lookup made in this process
(the contract's StagedLookup fed by raw batch_is_exist: timed whole, the in-process bound, and its calls alone, the
raw checks of the keys the daemon probes); and one raw check of every key, the cost a lookup probing everything can
never go under.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.mooncake_direct import DirectClient
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import BLOCK_TOKENS, hashes_for
from kvsidecar_bench.stats import Samples
from kvsidecar_contract.placement import (
    Geometry,
    Layout,
    Parallel,
    StagedLookup,
    compute_hit,
    lookup_plan,
    parse_groups,
)
from kvsidecar_testing.processes import DaemonProcess

__all__ = ["CASES", "GROUPS", "LookupPoint", "measure_lookups"]

GROUPS = "mla,full_attention,mamba"
TP = 8
KV_HEADS = 8
MODEL = "bench/lookup"
_VALUE_BYTES = 64  # per block and group: enough for a key to exist
CASES = {"full hit": 1.0, "10% hit": 0.1, "miss": 0.0}  # fraction of the prompt's blocks stored


@dataclass
class LookupPoint:
    """Latencies of one prompt length."""

    tokens: int
    keys: int  # every key of the prompt: what probing everything asks
    hit_tokens: int
    case: str = "full hit"
    probed: int = 0  # keys the staged lookup asks
    daemon: Samples = field(default_factory=Samples)
    raw: Samples = field(default_factory=Samples)  # raw checks of the keys the daemon probes, stage by stage
    # The same staged lookup made in this process (keys built here, then the raw checks): what a lookup costs an
    # engine that links Mooncake itself, the daemon's bound.
    in_process: Samples = field(default_factory=Samples)
    every: Samples = field(default_factory=Samples)  # one raw check of every key
    placement: Samples = field(default_factory=Samples)  # the staged plan and hit fixed point, in this process

    @property
    def overhead(self) -> float:
        """(daemon p50 - raw p50) / raw p50: the daemon's own cost over the store calls it makes."""
        return self.daemon.median_s / self.raw.median_s - 1

    @property
    def of_in_process(self) -> float:
        """daemon p50 / the same staged lookup made in-process."""
        return self.daemon.median_s / self.in_process.median_s

    @property
    def of_every(self) -> float:
        """daemon p50 / one raw check of every key."""
        return self.daemon.median_s / self.every.median_s


def _layout(rank: int) -> Layout:
    return Layout(MODEL, parse_groups(GROUPS, BLOCK_TOKENS), Parallel(tp_size=TP, tp_rank=rank), KV_HEADS, BLOCK_TOKENS)


def _client(daemon: DaemonProcess, rank: int, role: str) -> Any:
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

    return SidecarClient.connect(
        daemon.target,
        model=MODEL,
        layout=EngineLayout(tp_size=TP, tp_rank=rank),
        num_kv_heads=KV_HEADS,
        hash_block_size=BLOCK_TOKENS,
        groups=[GroupSpec(kind, BLOCK_TOKENS) for kind in GROUPS.split(",")],
        role=role,
        client_name="kvsidecar-bench",
    )


def _populate(daemon: DaemonProcess, hashes: list[bytes], tokens: int) -> None:
    import torch

    from kvsidecar_client import shared_tensor

    n = len(hashes)
    if not n:
        return
    for rank in range(TP):
        tensors = [shared_tensor((n, _VALUE_BYTES), torch.uint8) for _ in GROUPS.split(",")]
        for g, t in enumerate(tensors):
            t.fill_(rank * 16 + g + 1)
        with _client(daemon, rank, "rank") as client:
            client.register(tensors, [(g,) for g in range(len(tensors))])
            result = client.save(hashes, [list(range(n))] * len(tensors), tokens, timeout=300).result()
            if result.failed:
                raise BenchError(f"populating lookup keys: rank {rank} failed to save {result.failed} values")


def _staged(geo: Geometry, hashes: list[bytes], tokens: int, raw: DirectClient) -> tuple[int, float, int, float]:
    """The daemon's stages against the raw check: (hit tokens, seconds in the raw calls, keys probed, seconds in
    all: the keys built here and the calls)."""
    start = time.perf_counter()
    staged = StagedLookup(geo, hashes, tokens)
    seconds = 0.0
    while not staged.done:
        keys = staged.next_keys()
        t0 = time.perf_counter()
        found = raw.exist(keys) if keys else []
        seconds += time.perf_counter() - t0
        staged.record([f == 1 for f in found])
    return staged.answer().hit_tokens, seconds, staged.probes, time.perf_counter() - start


def measure_lookups(
    daemon: DaemonProcess,
    master: str,
    token_counts: Sequence[int],
    reps: int,
    progress: Progress,
    nonce: str,
    logs: Path,
) -> list[LookupPoint]:
    """p50/p99 of the daemon's Lookup and of the raw existence checks, interleaved, per prompt length and case."""
    # No segment: this client only asks the daemon's master, like the daemon does for a lookup.
    raw = DirectClient.with_segment(logs, master, 0)
    geo = Geometry.of(_layout(0))
    longest = max(token_counts)
    runs = [(t, case) for t in token_counts for case in CASES if case == "full hit" or t == longest]
    points = []
    try:
        for tokens, case in runs:
            hashes = hashes_for(f"{nonce}/lookup/{tokens}/{case}", tokens // BLOCK_TOKENS)
            stored = int(len(hashes) * CASES[case])
            _populate(daemon, hashes[:stored], stored * BLOCK_TOKENS)
            plan = lookup_plan(geo, hashes, tokens)
            expected_tokens, _, probed, _ = _staged(geo, hashes, tokens, raw)
            every = compute_hit(geo, tokens, plan.stored([f == 1 for f in raw.exist(plan.keys)])).hit_tokens
            if expected_tokens != every:
                raise BenchError(f"{case} lookup of {tokens} tokens: staged hit {expected_tokens}, probing all {every}")
            point = LookupPoint(tokens, len(plan.keys), expected_tokens, case, probed)
            with _client(daemon, 0, "scheduler") as scheduler:
                for i in range(reps + 2):  # the first two of each are warm-ups
                    record = i >= 2
                    order = ("daemon", "raw", "every") if i % 2 else ("every", "raw", "daemon")
                    for which in order:
                        if which == "daemon":
                            t0 = time.perf_counter()
                            hit = scheduler.lookup(hashes, tokens, timeout=60)
                            seconds = time.perf_counter() - t0
                            if hit.hit_tokens != expected_tokens or hit.degraded:
                                raise BenchError(f"{case} lookup of {tokens} tokens: {hit}, expected {expected_tokens}")
                        elif which == "raw":
                            got, seconds, _, in_all = _staged(geo, hashes, tokens, raw)
                            if got != expected_tokens:
                                raise BenchError(f"raw staged {case} lookup of {tokens} tokens hit {got}")
                            if record:
                                point.in_process.add(in_all)
                        else:
                            t0 = time.perf_counter()
                            found = raw.exist(plan.keys)
                            seconds = time.perf_counter() - t0
                            if sum(f == 1 for f in found) < stored:
                                raise BenchError(f"raw existence check of {tokens} tokens: saved keys are missing")
                        if record:
                            getattr(point, which).add(seconds)
                    if record:
                        t0 = time.perf_counter()
                        again = StagedLookup(geo, hashes, tokens)
                        while not again.done:
                            again.record([True] * len(again.next_keys()))
                        point.placement.add(time.perf_counter() - t0)
            points.append(point)
            raw.remove_model(MODEL)
            progress.step(f"lookup {tokens} tokens, {case}: {point.probed} of {point.keys} keys probed")
    finally:
        raw.close()
    return points
