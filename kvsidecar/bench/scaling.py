"""Section 3: 1, 2, 4, 8 ranks (separate processes) saving and loading at once through one daemon.

The largest number of rank processes is started once; a phase with N ranks tells the first N to run the same number
of rounds at the same moment. Reported: per-rank throughput (median over ranks of each rank's median), aggregate
throughput (all bytes moved / the phase's wall time), and the daemon's CPU seconds per GiB and RSS.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from kvsidecar.bench.procs import BenchError, DaemonProcess, stop_process
from kvsidecar.bench.progress import Progress
from kvsidecar.bench.shapes import scale_rank_shape
from kvsidecar.bench.stats import GIB, gib_per_s

__all__ = ["ScalePoint", "measure_scaling"]

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


class _Rank:
    def __init__(self, rank: int, config: dict[str, Any]) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar.bench.worker", json.dumps({**config, "rank": rank})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, message: dict[str, Any]) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(message) + "\n")
        stdin.flush()

    def receive(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise BenchError(f"rank process {self.rank} exited with {self.proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise BenchError(answer["error"])
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.send({"op": "quit"})
                self.proc.stdin.close()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process(self.proc)


def measure_scaling(
    daemon: DaemonProcess,
    rank_counts: Sequence[int],
    blocks: int,
    rounds: int,
    progress: Progress,
    nonce: str,
) -> list[ScalePoint]:
    """Run each phase and return its point."""
    config = {"target": daemon.target, "blocks": blocks, "nonce": f"{nonce}/scale"}
    ranks: list[_Rank] = []
    points = []
    try:
        for r in range(max(rank_counts)):
            ranks.append(_Rank(r, config))
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank in ranks:
            rank.receive()  # {"ready": true}; readline blocks, the timeout guards the whole start
            if time.monotonic() > deadline:
                raise BenchError("rank processes took too long to start")
        progress.step(f"{len(ranks)} rank processes ready")
        bytes_per_request = blocks * scale_rank_shape(0).value_bytes
        for n in rank_counts:
            before = daemon.stats()
            for rank in ranks[:n]:
                rank.send({"op": "run", "phase": f"n{n}", "rounds": rounds})
            answers = [rank.receive() for rank in ranks[:n]]
            after = daemon.stats()
            point = ScalePoint(n, rounds, bytes_per_request)
            for answer in answers:
                point.save_gib_s.append(gib_per_s(answer["bytes"], statistics.median(answer["save_s"])))
                point.load_gib_s.append(gib_per_s(answer["bytes"], statistics.median(answer["load_s"])))
            point.wall_s = max(a["end"] for a in answers) - min(a["start"] for a in answers)
            point.daemon_cpu_s = after.cpu_s - before.cpu_s
            point.daemon_rss_bytes = after.rss_bytes
            point.daemon_peak_rss_bytes = after.peak_rss_bytes
            points.append(point)
            ranks[0].send({"op": "reset"})
            ranks[0].receive()
            progress.step(f"{n} ranks: {point.aggregate_gib_s:.2f} GiB/s in all")
    finally:
        for rank in ranks:
            rank.stop()
    return points
