"""Section 1: save and load throughput of every path, interleaved round by round on the same buffers and keys.

First every shape's cold phase: distinct requests saved without clearing, so a store puts them in segment memory
never written before and pays its first-touch page faults (memcpy copies into freshly mapped pages). Then per shape
one correctness round (every path's loaded bytes must equal the saved ones) and, for each block count, warm rounds:
the same request saved, loaded and cleared every round, so segment memory is reused. Within a round the paths take
turns, in an order that rotates every round. With `device="cuda"` the engine memory is on cuda:0 (every path moves
the same GPU buffers) and the byte checks compare on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.paths import DataPath, Timing
from kvsidecar_bench.progress import Progress
from kvsidecar_bench.shapes import EngineMemory, ModelShape, Request
from kvsidecar_bench.stats import GIB, Samples, rotated

__all__ = ["OPS", "Point", "ShapeResult", "cold_bytes", "measure", "steps"]

OPS = ("save", "load", "save_cold")


@dataclass
class Point:
    """One path, one operation, one block count: durations plus the CPU they cost."""

    samples: Samples = field(default_factory=Samples)
    cpu_s: float = 0.0

    def add(self, timing: Timing, nbytes: int) -> None:
        """Record one run."""
        self.samples.add(timing.wall_s, nbytes)
        self.cpu_s += timing.cpu_s

    @property
    def cpu_s_per_gib(self) -> float:
        """CPU seconds (all processes on the path) per GiB moved."""
        moved = sum(self.samples.nbytes) / GIB
        return self.cpu_s / moved if moved else float("nan")


@dataclass
class ShapeResult:
    """Every point measured for one shape: results[op][blocks][path]."""

    shape: ModelShape
    results: dict[str, dict[int, dict[str, Point]]] = field(default_factory=dict)
    verified: dict[str, bool] = field(default_factory=dict)

    def point(self, op: str, blocks: int, path: str) -> Point:
        """The point, created on first use."""
        return self.results.setdefault(op, {}).setdefault(blocks, {}).setdefault(path, Point())


def steps(shapes: int, blocks: Sequence[int], rounds: int, cold_rounds: int) -> int:
    """Progress units of the section."""
    return shapes * (cold_rounds + 1 + len(blocks) * (rounds + 1))


def cold_bytes(shapes: Sequence[ModelShape], cold_blocks: int, cold_rounds: int) -> int:
    """Segment bytes the cold phases fill (they must fit, or later puts would evict or fail)."""
    return sum(cold_rounds * cold_blocks * shape.value_bytes for shape in shapes)


def measure(
    shapes: Sequence[ModelShape],
    paths: Sequence[DataPath],
    blocks: Sequence[int],
    rounds: int,
    cold_blocks: int,
    cold_rounds: int,
    progress: Progress,
    nonce: str,
    device: str = "cpu",
) -> list[ShapeResult]:
    """Every shape's cold phase first (fresh segment memory for all of them), then every shape's warm phase."""
    top = max([*blocks, cold_blocks])
    out = [ShapeResult(shape) for shape in shapes]
    for result in out:
        shape = result.shape
        with _begun(paths, shape, EngineMemory.allocate(shape, 2 * top, 1, device)):
            for r in range(cold_rounds):
                request = Request.of(shape, f"{nonce}/{shape.name}/cold/{r}", cold_blocks, top)
                for path in rotated(paths, r):
                    timing = path.save(request, fresh=True)
                    result.point("save_cold", cold_blocks, path.name).add(timing, request.nbytes)
                progress.step(f"{shape.name} cold segment, {cold_blocks} blocks, round {r + 1}/{cold_rounds}")
    for result in out:
        shape = result.shape
        memory = EngineMemory.allocate(shape, 2 * top, 2, device)
        with _begun(paths, shape, memory):
            for path in paths:
                path.clear()  # this shape's cold values
            _verify(result, paths, memory, Request.of(shape, f"{nonce}/{shape.name}/verify", min(blocks), top))
            progress.step(f"{shape.name}: every path loads the bytes it saved")
            for n in blocks:
                request = Request.of(shape, f"{nonce}/{shape.name}/warm/{n}", n, top)
                for r in range(rounds + 1):  # round 0 warms up and is not recorded
                    order = rotated(paths, r)
                    for path in order:
                        timing = path.save(request)
                        if r:
                            result.point("save", n, path.name).add(timing, request.nbytes)
                    for path in order:
                        timing = path.load(request)
                        if r:
                            result.point("load", n, path.name).add(timing, request.nbytes)
                    for path in order:
                        path.clear()
                    progress.step(f"{shape.name}, {n} blocks, round {r}/{rounds}")
    return out


@contextlib.contextmanager
def _begun(paths: Sequence[DataPath], shape: ModelShape, memory: EngineMemory) -> Iterator[None]:
    begun: list[DataPath] = []
    try:
        for path in paths:
            path.begin(shape, memory)
            begun.append(path)
        yield
    finally:
        for path in begun:
            path.end()


def _verify(out: ShapeResult, paths: Sequence[DataPath], memory: EngineMemory, request: Request) -> None:
    for path in paths:
        mine = path.memory or memory
        mine.clear_blocks(request.load_ids)
        path.save(request)
        path.load(request)
        path.clear()
        ok = mine.same_blocks(request.save_ids, request.load_ids)
        out.verified[path.name] = ok
        if not ok:
            raise BenchError(f"the {path.name} path loaded bytes that differ from the ones it saved")
