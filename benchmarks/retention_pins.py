"""What retention costs the store: a put with a soft pin against an ordinary one, and pinning values already stored
(read into the daemon's scratch buffer and written back: store/pins.py), side by side on the same master.

    python benchmarks/retention_pins.py [--values 64] [--value-mib 1] [--repeat 5]

One MooncakeStore over an embedded master on loopback, its own segment (the memcpy fast path, as the daemon's).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store import Pin, StoreCode
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore
from kvsidecar_testing.mooncake_env import MooncakeEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=64)
    parser.add_argument("--value-mib", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n, size = args.values, args.value_mib << 20
    with MooncakeEnv() as env:
        os.environ.update(env.variables())
        master = EmbeddedMaster(env=env.variables()).start()
        settings = MooncakeSettings(
            local_hostname="127.0.0.1", master_server_addr=master.address, global_segment_size=8 * n * size
        )
        store = MooncakeStore.connect(settings)
        try:
            rows = measure(store, n, size, args.repeat)
        finally:
            store.close()
            master.stop()
    total = n * size / 2**30
    print(f"| {n} values of {args.value_mib} MiB | ms (median of {args.repeat}) | GiB/s | x ordinary put |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(rows["ordinary put"])
    for name, times in rows.items():
        t = statistics.median(times)
        print(f"| {name} | {1e3 * t:.1f} | {total / t:.2f} | {t / base:.2f} |")


def measure(store: MooncakeStore, n: int, size: int, repeat: int) -> dict[str, list[float]]:
    buffer = ctypes.create_string_buffer(n * size)
    base = ctypes.addressof(buffer)
    store.register_buffer(base, n * size)
    addresses, sizes = [[base + i * size] for i in range(n)], [[size]] * n
    soft, hard = Pin(ttl_ms=600_000), Pin(hard=True)
    rows: dict[str, list[float]] = {}
    for r in range(repeat):
        plain, pinned = [f"plain{r}/{i}" for i in range(n)], [f"pinned{r}/{i}" for i in range(n)]
        timed(rows, "ordinary put", partial(store.put_from, plain, addresses, sizes))
        timed(rows, "soft-pinned put", partial(store.put_from, pinned, addresses, sizes, pin=soft))
        timed(rows, "pin stored: soft", partial(store.pin, plain, [size] * n, soft))
        timed(rows, "pin stored: hard", partial(store.pin, plain, [size] * n, hard))
        store.remove(plain + pinned)
    return rows


def timed(rows: dict[str, list[float]], name: str, call: Callable[[], list[StoreCode]]) -> None:
    start = time.perf_counter()
    codes = call()
    rows.setdefault(name, []).append(time.perf_counter() - start)
    assert all(c is StoreCode.OK for c in codes), (name, codes)


if __name__ == "__main__":
    main()
