"""What a save's last hop costs in Mooncake on this machine, for the GPU path's choice of how to put (issue 39 item 1).

    python benchmarks/mooncake_copies.py [--values 128] [--rounds 7]

A daemon's store client puts into its own segment with LOCAL_MEMCPY: every value one copy on the client's single
copy worker (`kDefaultMemcpyWorkers = 1` in mooncake-store/src/transfer_task.cpp, whatever the API: ranged session
writes use the same pool). Measured here with host buffers (the non-CUDA build; what a put from page-locked host
staging would be on a GPU node): per value size, the put's microseconds per value and GiB/s against a plain memcpy
of the same bytes, and a batch put as two halves in flight from two threads against one batch. Prints Markdown.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
import time

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store import StoreCode
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
from kvsidecar_testing.mooncake_env import MooncakeEnv

KiB, MiB, GIB = 1 << 10, 1 << 20, float(1 << 30)
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=128, help="values per batch put (default 128)")
    parser.add_argument("--rounds", type=int, default=7, help="repeats per figure; the median is printed")
    args = parser.parse_args()
    env = MooncakeEnv()
    os.environ.update(env.variables())
    master = EmbeddedMaster(env=env.variables()).start()
    largest = max(SIZES) * args.values
    settings = MooncakeSettings(
        local_hostname="127.0.0.1", master_server_addr=master.address, global_segment_size=largest + 256 * MiB
    )
    store = MooncakeStore.connect(settings)
    if store.prefault is not None:
        store.prefault.done.wait(300)  # its thread would take CPU from the copies measured
    source = ctypes.create_string_buffer(largest)
    ctypes.memset(source, 7, largest)
    scratch = ctypes.create_string_buffer(largest)
    base, spare = ctypes.addressof(source), ctypes.addressof(scratch)
    store.register_buffer(base, largest)
    runs = iter(range(1 << 30))

    def put(size: int, first: int, n: int) -> None:
        tag = next(runs)
        keys = [f"copies/{tag}/{i}" for i in range(n)]
        codes = store.put_from(keys, [[base + (first + i) * size] for i in range(n)], [[size]] * n)
        assert codes == [StoreCode.OK] * n, codes[:3]

    def timed(*fns) -> list[float]:  # type: ignore[no-untyped-def]
        """The median seconds of each fn, taking turns round by round (drift on a busy machine hits all alike)."""
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(args.rounds):
            for fn, out in zip(fns, times, strict=True):
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
                store.remove_prefix("copies/")
        return [statistics.median(t) for t in times]

    def memcpy(size: int, n: int) -> None:
        for i in range(n):
            ctypes.memmove(spare + i * size, base + i * size, size)

    def halves(size: int, n: int) -> None:
        threads = [threading.Thread(target=put, args=(size, k * n // 2, n // 2)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    n = args.values
    print(f"Mooncake `put_from` of {n} host values into the client's own segment (LOCAL_MEMCPY), median of "
          f"{args.rounds}\n")  # fmt: skip
    print("| value | put: us per value | put GiB/s | memcpy GiB/s | put / memcpy | two halves in flight / one batch |")
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for size in SIZES:
            memcpy(size, n)  # the pages of the scratch touched once
            one, copy, two = timed(
                lambda size=size: put(size, 0, n), lambda size=size: memcpy(size, n), lambda size=size: halves(size, n)
            )
            gib = size * n / GIB
            print(
                f"| {size // KiB} KiB | {one / n * 1e6:.1f} | {gib / one:.2f} | {gib / copy:.2f} | "
                f"{copy / one:.2f}x | {one / two:.2f}x |"
            )
    finally:
        store.close()
        master.stop()
        env.close()


if __name__ == "__main__":
    main()
