"""Mooncake's batch put and get through a second mapping of the engine's memory, against the first, in one process.

    python benchmarks/second_mapping.py [--blocks 8] [--rounds 200]

The daemon copies between its Mooncake segment and its own MAP_SHARED mapping of the rank's memfds; the rank (and
in-process Mooncake) through the rank's mapping. This isolates that one difference: two Mooncake clients of this
process, each with its own master and segment, the same calls on the same MLA blocks, taking turns; one uses the
tensors' own mapping, the other a second mapping of the same memfds (`--swap` exchanges them). No gRPC, no daemon.
Prints p50 ms of batch_is_exist, batch_put_from_multi_buffers and batch_get_into_multi_buffers per client.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvsidecar.master import EmbeddedMaster
from kvsidecar.testing.mooncake_env import CLIENT_ENV
from kvsidecar_bench.mooncake_direct import DirectClient
from kvsidecar_bench.shapes import SHAPES, EngineMemory, Request
from kvsidecar_contract.placement import Geometry


def second_mapping(base: int) -> tuple[int, mmap.mmap]:
    """The address of `base` in a new MAP_SHARED mapping of the file behind it (the daemon maps memfds this way)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span = line.split()[0]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= base < high:
                break
        else:
            raise LookupError(f"0x{base:x} is not mapped")
    fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
    try:
        area = mmap.mmap(fd, high - low, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return ctypes.addressof(ctypes.c_char.from_buffer(area)) + (base - low), area


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--swap", action="store_true", help="the other client takes the second mapping")
    args = parser.parse_args()
    os.environ.update(CLIENT_ENV)
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-mapping-"))
    shape = SHAPES["mla"]
    with EmbeddedMaster(log_path=work / "a.log") as a, EmbeddedMaster(log_path=work / "b.log") as b:
        clients = {
            "first mapping": DirectClient.with_segment(work / "mc.log", a.address, 1 << 30),
            "second mapping": DirectClient.with_segment(work / "mc.log", b.address, 1 << 30),
        }
        if args.swap:
            clients = dict(zip(clients, reversed(clients.values()), strict=True))
        memory = EngineMemory.shared(shape, 2 * args.blocks, seed=1)
        moved = {t.data_ptr(): second_mapping(t.data_ptr()) for t in memory.tensors}
        again = {base: address for base, (address, _) in moved.items()}

        def addresses(name: str, block: int) -> list[int]:
            own = memory.addresses(block)
            if name == "first mapping":
                return own
            return [again[base] + (x - base) for x, base in zip(own, memory.bases, strict=True)]

        for name, client in clients.items():
            for base, size in memory.buffers():
                client.register(base if name == "first mapping" else again[base], size)
        geo = Geometry.of(shape.layout("bench/mla"))
        request = Request.of(shape, f"mapping/{time.time()}", args.blocks, args.blocks)
        keys = [c.key for c in request.save_chunks(geo)]
        sizes = memory.sizes
        times: dict[str, list[float]] = {f"{n} {op}": [] for n in clients for op in ("exists", "put", "get")}
        for r in range(args.rounds):
            for name, client in clients.items() if r % 2 else reversed(clients.items()):
                t0 = time.perf_counter()
                client.exist(keys)
                t1 = time.perf_counter()
                client.native.batch_put_from_multi_buffers(
                    keys, [addresses(name, i) for i in request.save_ids], [sizes] * len(keys), client.config
                )
                t2 = time.perf_counter()
                client.get_into(keys, [addresses(name, i) for i in request.load_ids], sizes)
                t3 = time.perf_counter()
                client.native.batch_remove(keys, True)
                times[f"{name} exists"].append(t1 - t0)
                times[f"{name} put"].append(t2 - t1)
                times[f"{name} get"].append(t3 - t2)
        for what, values in times.items():
            print(f"{what:22s} p50 {1e3 * statistics.median(values):.3f} ms")
        for client in clients.values():
            client.close()


if __name__ == "__main__":
    main()
