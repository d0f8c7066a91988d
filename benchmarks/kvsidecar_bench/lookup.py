"""Section 2: lookup latency through the daemon against Mooncake's raw batch existence check of the same keys.

Layout: T=8, H=8, groups [mla, full_attention, mamba], 16-token blocks: 17 namespaces per boundary. Eight rank
sessions first save every block of the prompt through the daemon (tiny values: a lookup only asks whether keys
exist), so the daemon's answer is a full hit; then a scheduler session's Lookup and the raw check of the keys the
daemon probes take turns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.testing.processes import Daemon
from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.mooncake_direct import DirectClient
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import BLOCK_TOKENS, hashes_for
from kvsidecar_bench.stats import Samples
from kvsidecar_contract.placement import Geometry, Layout, Parallel, compute_hit, lookup_plan, parse_groups

__all__ = ["GROUPS", "LookupPoint", "measure_lookups"]

GROUPS = "mla,full_attention,mamba"
TP = 8
KV_HEADS = 8
MODEL = "bench/lookup"
_VALUE_BYTES = 64  # per block and group: enough for a key to exist


@dataclass
class LookupPoint:
    """Latencies of one prompt length."""

    tokens: int
    keys: int
    hit_tokens: int
    daemon: Samples = field(default_factory=Samples)
    raw: Samples = field(default_factory=Samples)
    placement: Samples = field(default_factory=Samples)  # lookup plan + hit fixed point, in this process

    @property
    def overhead(self) -> float:
        """(daemon p50 - raw p50) / raw p50."""
        return self.daemon.median_s / self.raw.median_s - 1


def _layout(rank: int) -> Layout:
    return Layout(MODEL, parse_groups(GROUPS, BLOCK_TOKENS), Parallel(tp_size=TP, tp_rank=rank), KV_HEADS, BLOCK_TOKENS)


def _client(daemon: Daemon, rank: int, role: str) -> Any:
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


def _populate(daemon: Daemon, hashes: list[bytes], tokens: int) -> None:
    import torch

    from kvsidecar_client import shared_tensor

    n = len(hashes)
    for rank in range(TP):
        tensors = [shared_tensor((n, _VALUE_BYTES), torch.uint8) for _ in GROUPS.split(",")]
        for g, t in enumerate(tensors):
            t.fill_(rank * 16 + g + 1)
        with _client(daemon, rank, "rank") as client:
            client.register(tensors, [(g,) for g in range(len(tensors))])
            result = client.save(hashes, [list(range(n))] * len(tensors), tokens, timeout=300).result()
            if result.failed:
                raise BenchError(f"populating lookup keys: rank {rank} failed to save {result.failed} values")


def measure_lookups(
    daemon: Daemon,
    master: str,
    token_counts: Sequence[int],
    reps: int,
    progress: Progress,
    nonce: str,
    logs: Path,
) -> list[LookupPoint]:
    """p50/p99 of the daemon's Lookup and of the raw existence check, interleaved, for each prompt length."""
    # No segment: this client only asks the daemon's master, like the daemon does for a lookup.
    raw = DirectClient.with_segment(logs, master, 0)
    geo = Geometry.of(_layout(0))
    points = []
    try:
        for tokens in token_counts:
            hashes = hashes_for(f"{nonce}/lookup/{tokens}", tokens // BLOCK_TOKENS)
            _populate(daemon, hashes, tokens)
            plan = lookup_plan(geo, hashes, tokens)
            expected = compute_hit(geo, tokens, plan.stored([True] * len(plan.keys))).tokens
            point = LookupPoint(tokens, len(plan.keys), expected)
            with _client(daemon, 0, "scheduler") as scheduler:
                for i in range(reps + 2):  # the first two of each are warm-ups
                    record = i >= 2
                    for which in ("daemon", "raw") if i % 2 else ("raw", "daemon"):
                        if which == "daemon":
                            t0 = time.perf_counter()
                            hit = scheduler.lookup(hashes, tokens, timeout=60)
                            seconds = time.perf_counter() - t0
                            if hit.hit_tokens != expected or hit.degraded:
                                raise BenchError(f"lookup of {tokens} tokens hit {hit} (expected {expected})")
                        else:
                            t0 = time.perf_counter()
                            found = raw.exist(plan.keys)
                            seconds = time.perf_counter() - t0
                            if any(f != 1 for f in found):
                                raise BenchError(f"raw existence check of {tokens} tokens: not every key exists")
                        if record:
                            getattr(point, which).add(seconds)
                    if record:
                        t0 = time.perf_counter()
                        again = lookup_plan(geo, hashes, tokens)
                        compute_hit(geo, tokens, again.stored([True] * len(again.keys)))
                        point.placement.add(time.perf_counter() - t0)
            points.append(point)
            raw.remove_model(MODEL)
            progress.step(f"lookup {tokens} tokens: {point.keys} keys")
    finally:
        raw.close()
    return points
