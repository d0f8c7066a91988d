"""How a save's values reach the store on a GPU node (issue 39 item 1), measured for the check's summary.

A daemon's store client puts into its own page-locked segment on one copy worker, one copy per value (Mooncake's
`kDefaultMemcpyWorkers = 1`, whatever the API). The device mover puts from device staging, so each value is one
synchronous cudaMemcpy there; the alternative is the daemon's own DMA of a round into page-locked host memory and a
put from there, each value then one memcpy of the worker's. Both against the DMA alone (the link), at the values of
GQA at TP=8 (256 KiB), MLA (1 MiB) and GQA (2 MiB), and the put from device staging with two batches in flight. The
device mover keeps the first unless this shows the second faster. Skipped without a GPU (benchmarks/mooncake_copies.py
measures the host side on any machine).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store import StoreCode
from kvsidecar.store.build import installed_build
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and Mooncake's CUDA build"),
]

KiB, MiB, GIB = 1 << 10, 1 << 20, float(1 << 30)
BATCH = 256 * MiB
_PORTABLE = 1


@pytest.fixture(scope="module")
def store(mooncake_client_env) -> Iterator[MooncakeStore]:  # type: ignore[no-untyped-def]
    if not installed_build().cuda:
        pytest.skip(f"Mooncake's non-CUDA build cannot read GPU memory: {installed_build().describe()}")
    master = EmbeddedMaster().start()
    store = MooncakeStore.connect(
        MooncakeSettings(local_hostname="127.0.0.1", master_server_addr=master.address, global_segment_size=2 << 30)
    )
    segment = store.segment()
    assert segment is not None
    if store.prefault is not None:
        store.prefault.done.wait(120)
    low = segment.address - segment.address % 4096
    assert int(torch.cuda.cudart().cudaHostRegister(low, segment.size, _PORTABLE)) == 0  # as the daemon locks it
    try:
        yield store
    finally:
        torch.cuda.cudart().cudaHostUnregister(low)
        store.close()
        master.stop()


def median_s(fn: Callable[[], object], store: MooncakeStore, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        store.remove_prefix("copies/")
    return statistics.median(times)


@pytest.mark.parametrize("size", [256 * KiB, 1 * MiB, 2 * MiB], ids=["256KiB", "1MiB", "2MiB"])
def test_a_put_from_device_staging_against_a_put_from_pinned_host_and_the_dma(store, size):
    n = BATCH // size
    staging = torch.randint(0, 255, (BATCH,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(BATCH, dtype=torch.uint8, pin_memory=True)
    tag = iter(range(1 << 30))

    def put(base: int, first: int, count: int) -> None:
        keys = [f"copies/{next(tag)}/{i}" for i in range(count)]
        addresses = [[base + (first + i) * size] for i in range(count)]
        codes = store.put_from(keys, addresses, [[size]] * count, device=True)
        assert codes == [StoreCode.OK] * count, codes[:3]

    def dma() -> None:
        pinned.copy_(staging, non_blocking=True)
        torch.cuda.synchronize()

    def from_host() -> None:
        dma()
        put(pinned.data_ptr(), 0, n)

    def two_in_flight() -> None:
        halves = [threading.Thread(target=put, args=(staging.data_ptr(), k * n // 2, n // 2)) for k in range(2)]
        for t in halves:
            t.start()
        for t in halves:
            t.join()

    device = median_s(lambda: put(staging.data_ptr(), 0, n), store)
    host = median_s(from_host, store)
    link = median_s(dma, store)
    two = median_s(two_in_flight, store)
    gib = BATCH / GIB
    print(
        f"RESULT save copies {size // KiB} KiB x {n}: from device staging {gib / device:.1f} GiB/s "
        f"({device / n * 1e6:.1f} us a value), DMA + from pinned host {gib / host:.1f}, DMA alone {gib / link:.1f}; "
        f"device/DMA {link / device:.2f}x, two puts in flight {device / two:.2f}x one",
        flush=True,
    )
    # The bytes a put from device memory stored are the device's.
    probe = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    keys = ["copies/check"]
    assert store.put_from(keys, [[staging.data_ptr()]], [[size]], device=True) == [StoreCode.OK]
    assert store.get_into(keys, [[probe.data_ptr()]], [[size]]) == [StoreCode.OK]
    assert torch.equal(probe, staging[:size].cpu())
    store.remove_prefix("copies/")
