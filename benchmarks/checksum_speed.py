"""What a checksum costs on this CPU over the data path's real values, against a memcpy of the same bytes.

    python benchmarks/checksum_speed.py [--blocks 64] [--rounds 7]

Per shape of the bench (MLA: 61 slices of 18 KiB; GQA: 64 of 32 KiB; GQA at TP=8: 64 of 4 KiB), the engine's
memory as vLLM lays it out (one tensor per layer and K/V, a block's slice in each), and per value, side by side in
one run, each taking turns: xxh3-64 over the key and the value's slices (what the daemon does:
kvsidecar/movers/trailer.py `digest`), CRC32C over the same slices (`crc32c`, a C implementation with SSE4.2 / ARMv8
instructions; `pip install crc32c` to include it), and a memcpy of the slices into one buffer (the store's copy of a
put from the memfd to its segment, its cheapest hop). Prints the median GiB/s of each, its time as a fraction of the
memcpy's, and xxh3 on two threads at once (the hash releases the GIL: about twice one thread's rate where two cores
are free).

Also what the allocator makes of a trailer: Mooncake rounds every object up to a size class (3 mantissa bits), so
16 bytes more on a value can take 12.5% more of the segment (measured from the replicas' addresses in the full run
with a master: benchmarks/crossing.py --checksums).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import xxhash

from kvsidecar.movers.trailer import digest
from kvsidecar_bench.shapes import SHAPES, ModelShape

GIB = 1 << 30


def size_class(size: int) -> int:
    """The bytes Mooncake's offset allocator takes for an object of size bytes (its bins: 3 mantissa bits)."""
    if size < 8:
        return size
    high = size.bit_length() - 1
    shift = high - 3
    rounded = (size >> shift) << shift
    return rounded if rounded == size else rounded + (1 << shift)


class Memory:
    """A rank's KV cache of one shape: one buffer per tensor, `blocks` slices in each."""

    def __init__(self, shape: ModelShape, blocks: int) -> None:
        self.shape = shape
        self.blocks = blocks
        size = shape.slice_bytes * blocks
        self.tensors = [(ctypes.c_uint8 * size)() for _ in range(shape.regions)]
        for i, t in enumerate(self.tensors):
            ctypes.memset(t, (i * 37 + 11) & 0xFF, size)
        self.views = [memoryview(t) for t in self.tensors]
        self.out = (ctypes.c_uint8 * shape.value_bytes)()

    def slices(self, block: int) -> list[memoryview]:
        n = self.shape.slice_bytes
        return [v[block * n : (block + 1) * n] for v in self.views]

    def addresses(self, block: int) -> list[int]:
        n = self.shape.slice_bytes
        return [ctypes.addressof(t) + block * n for t in self.tensors]


def xxh3_all(memory: Memory) -> None:
    for b in range(memory.blocks):
        digest(f"key{b}", memory.slices(b))


def crc32c_all(memory: Memory) -> None:
    import crc32c

    for b in range(memory.blocks):
        value = crc32c.crc32c(f"key{b}".encode())
        for part in memory.slices(b):
            value = crc32c.crc32c(part, value)


def memcpy_all(memory: Memory) -> None:
    out, n = ctypes.addressof(memory.out), memory.shape.slice_bytes
    for b in range(memory.blocks):
        at = out
        for address in memory.addresses(b):
            ctypes.memmove(at, address, n)
            at += n


def xxh3_two_threads(memory: Memory) -> None:
    half = memory.blocks // 2

    def part(first: int, last: int) -> None:
        for b in range(first, last):
            digest(f"key{b}", memory.slices(b))

    other = threading.Thread(target=part, args=(half, memory.blocks))
    other.start()
    part(0, half)
    other.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="values hashed per timing")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default="mla,gqa,gqa-tp8")
    args = parser.parse_args()
    try:
        import crc32c  # noqa: F401

        have_crc = True
    except ImportError:
        have_crc = False
    ways: dict[str, Callable[[Memory], None]] = {"memcpy": memcpy_all, "xxh3": xxh3_all}
    if have_crc:
        ways["crc32c"] = crc32c_all
    ways["xxh3, 2 threads"] = xxh3_two_threads
    print(f"xxhash {xxhash.VERSION} (xxh3), {'crc32c' if have_crc else 'no crc32c (pip install crc32c)'}")
    print("| shape | value | allocated, +16 B trailer | " + " | ".join(f"{w} GiB/s" for w in ways) + " | "
          + " | ".join(f"{w} / memcpy time" for w in ways if w != "memcpy") + " |")  # fmt: skip
    print("|" + " --- |" * (3 + 2 * len(ways) - 1))
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        memory = Memory(shape, args.blocks)
        seconds: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(args.rounds + 1):
            order = list(ways.items())
            order = order[r % len(order) :] + order[: r % len(order)]
            for way, fn in order:
                t0 = time.perf_counter()
                fn(memory)
                if r:
                    seconds[way].append(time.perf_counter() - t0)
        nbytes = args.blocks * shape.value_bytes
        median = {w: statistics.median(s) for w, s in seconds.items()}
        rates = " | ".join(f"{nbytes / median[w] / GIB:.2f}" for w in ways)
        ratios = " | ".join(f"{median[w] / median['memcpy']:.2f}" for w in ways if w != "memcpy")
        v = shape.value_bytes
        grown = size_class(v + 16) / size_class(v)
        print(f"| {name} | {shape.regions} x {shape.slice_bytes // 1024} KiB | {grown:.3f}x | {rates} | {ratios} |")


if __name__ == "__main__":
    main()
