"""Section 3: 1, 2, 4, 8 ranks (separate processes) saving and loading at once through one daemon.

The largest number of rank processes is started once; a phase with N ranks tells the first N to run the same number
of rounds at the same moment. Reported: per-rank throughput (median over ranks of each rank's median), aggregate
throughput (all bytes moved / the phase's wall time), and the daemon's CPU seconds per GiB and RSS.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.machine import process_stats
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import BLOCK_TOKENS, EngineMemory, Request, scale_rank_shape
from kvsidecar_bench.stats import GIB, gib_per_s
from kvsidecar_testing.processes import DaemonProcess
from kvsidecar_testing.ranks import RankError, RankProcess, each

__all__ = ["MODEL", "ScalePoint", "ScaleRank", "measure_scaling"]

MODEL = "bench/scale"
_READY_TIMEOUT_S = 120.0


@dataclass
class ScalePoint:
    """One phase: N ranks at once."""

    ranks: int
    rounds: int
    bytes_per_request: int
    save_gib_s: list[float] = field(default_factory=list)  # per rank: its median save throughput
    load_gib_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    daemon_cpu_s: float = 0.0
    daemon_rss_bytes: int = 0
    daemon_peak_rss_bytes: int = 0

    @property
    def moved_bytes(self) -> int:
        """Bytes saved plus bytes loaded, all ranks."""
        return 2 * self.ranks * self.rounds * self.bytes_per_request

    @property
    def aggregate_gib_s(self) -> float:
        """All bytes moved over the phase's wall time."""
        return gib_per_s(self.moved_bytes, self.wall_s)

    @property
    def per_rank_save(self) -> float:
        """Median over ranks of their save throughput."""
        return statistics.median(self.save_gib_s)

    @property
    def per_rank_load(self) -> float:
        """Median over ranks of their load throughput."""
        return statistics.median(self.load_gib_s)

    @property
    def daemon_cpu_s_per_gib(self) -> float:
        """Daemon CPU seconds per GiB moved."""
        return self.daemon_cpu_s / (self.moved_bytes / GIB)


class ScaleRank:
    """One engine rank of a TP-8 engine in its own process (kvsidecar_testing.ranks drives it): a session and its
    registered KV cache; `run` saves and loads `rounds` requests and answers with its timings."""

    def __init__(self, target: str, rank: int, blocks: int, nonce: str) -> None:
        import torch

        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

        torch.set_num_threads(1)  # see runner._one_torch_thread
        self.rank, self.blocks, self.nonce = rank, blocks, nonce
        self.shape = scale_rank_shape(rank)
        self.memory = EngineMemory.shared(self.shape, 2 * blocks, seed=rank + 1)
        self.client = SidecarClient.connect(
            target,
            model=MODEL,
            layout=EngineLayout(tp_size=self.shape.tp_size, tp_rank=rank),
            num_kv_heads=self.shape.kv_heads,
            hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec(self.shape.group, BLOCK_TOKENS)],
            client_name=f"kvsidecar-bench rank {rank}",
        )
        try:
            self.client.register(self.memory.tensors, [(0,)] * len(self.memory.tensors))
        except BaseException:
            self.client.close()
            raise

    def run(self, phase: str, rounds: int) -> dict[str, Any]:
        from kvsidecar_client import Hit

        saves: list[float] = []
        loads: list[float] = []
        start = time.time()
        nbytes = 0
        blocks = self.blocks
        for r in range(rounds):
            request = Request.of(self.shape, f"{self.nonce}/{phase}/{r}", blocks, blocks)
            nbytes = request.nbytes
            t0 = time.perf_counter()
            saved = self.client.save(request.hashes, [request.save_ids], request.num_tokens).result()
            saves.append(time.perf_counter() - t0)
            # The scheduler's lookup needs every TP rank's shard; with fewer ranks running, the hit it would report
            # for this rank's own blocks is built here.
            tokens = blocks * BLOCK_TOKENS
            t0 = time.perf_counter()
            loaded = self.client.load_detailed(request.hashes, [request.load_ids], Hit(tokens, (tokens,)))
            loads.append(time.perf_counter() - t0)
            if saved.written != blocks or loaded.loaded != blocks:
                raise BenchError(f"rank {self.rank}: wrote {saved.written}, loaded {loaded.loaded} of {blocks} blocks")
        return {"save_s": saves, "load_s": loads, "bytes": nbytes, "start": start, "end": time.time()}

    def reset(self) -> int:
        return int(self.client.reset())

    def exit(self) -> None:
        self.client.close()


def measure_scaling(
    daemon: DaemonProcess,
    rank_counts: Sequence[int],
    blocks: int,
    rounds: int,
    progress: Progress,
    nonce: str,
    workdir: Path,
) -> list[ScalePoint]:
    """Run each phase and return its point."""
    ranks = [
        RankProcess(ScaleRank, daemon.target, r, blocks, f"{nonce}/scale", name=f"rank{r}",
                    log_path=workdir / f"scale-rank{r}.log")
        for r in range(max(rank_counts))
    ]  # fmt: skip
    points = []
    try:
        for rank in ranks:
            rank.spawn()
        for rank in ranks:
            rank.wait_ready(_READY_TIMEOUT_S)
        progress.step(f"{len(ranks)} rank processes ready")
        bytes_per_request = blocks * scale_rank_shape(0).value_bytes
        for n in rank_counts:
            before = process_stats(daemon.pid)
            answers = each(ranks[:n], "run", [{"phase": f"n{n}", "rounds": rounds}] * n, timeout=600)
            after = process_stats(daemon.pid)
            point = ScalePoint(n, rounds, bytes_per_request)
            for answer in answers:
                point.save_gib_s.append(gib_per_s(answer["bytes"], statistics.median(answer["save_s"])))
                point.load_gib_s.append(gib_per_s(answer["bytes"], statistics.median(answer["load_s"])))
            point.wall_s = max(a["end"] for a in answers) - min(a["start"] for a in answers)
            point.daemon_cpu_s = after.cpu_s - before.cpu_s
            point.daemon_rss_bytes = after.rss_bytes
            point.daemon_peak_rss_bytes = after.peak_rss_bytes
            points.append(point)
            ranks[0].call("reset")
            progress.step(f"{n} ranks: {point.aggregate_gib_s:.2f} GiB/s in all")
    except (RankError, TimeoutError) as exc:
        raise BenchError(f"a scaling rank failed: {exc}") from None
    finally:
        for rank in ranks:
            if rank.proc is not None:
                rank.stop()
    return points
