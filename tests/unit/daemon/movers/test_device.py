"""The device path end to end through the DataPath, a CPU standing in for the GPU, over the in-memory store: it stores
exactly the values the host path stores, loads them back into any blocks, moves requests larger than its staging in
rounds, never scatters a value that was not read, and refuses what it cannot move."""

from __future__ import annotations

import threading

import pytest

from kvsidecar.errors import BadRequest, DeviceUnavailable, StoreError
from kvsidecar.movers.accelerators import Cpu, cuda_error
from kvsidecar.movers.device import rounds
from kvsidecar.movers.staging import SLOTS
from kvsidecar.reasons import Reason
from kvsidecar.store import StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar_contract.placement import GroupSpec, Kind
from support.devicepath import KiB, hashes, rank

HYBRID = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))


def test_rounds_pack_aligned_values_up_to_the_capacity():
    assert list(rounds([100, 100, 100], 512)) == [[0, 1], [2]]
    assert list(rounds([256] * 4, 1024)) == [[0, 1, 2, 3]]
    assert list(rounds([], 1024)) == []
    with pytest.raises(ValueError, match="does not fit"):
        list(rounds([2048], 1024))


@pytest.mark.parametrize("groups", [HYBRID[1:2], HYBRID])
def test_the_device_path_stores_exactly_the_values_the_host_path_stores(groups):
    device_store, host_store = MemoryStore(), MemoryStore()
    with rank(device_store, groups=groups) as dev, rank(host_store, groups=groups, device=False) as host:
        dev.fill(7)
        host.fill(7)
        h = hashes("same", 6)
        ids = [[3, 9, 1, 0, 30, 12]] * len(groups)
        assert dev.save(h, ids).written == host.save(h, ids).written > 0
    assert device_store.keys() == host_store.keys()
    for key in host_store.keys():
        assert device_store.value(key) == host_store.value(key), key


def test_a_load_scatters_every_value_into_its_block_and_nothing_else():
    store = MemoryStore()
    groups = HYBRID[:2]  # every block of a prefix is loaded (a recurrent group loads only the hit's state)
    with rank(store, groups=groups) as r:
        r.fill(1)
        h = hashes("p", 5)
        saved = [[0, 1, 2, 3, 4]] * 2
        assert r.save(h, saved).written == 10
        before = {(g, b): r.value(g, b) for g in range(2) for b in range(32)}
        targets = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 31]]
        out = r.load(h, targets)
        assert (out.loaded, out.failures) == (10, ())
        for g in range(2):
            moved = dict(zip(targets[g], saved[g], strict=True))
            for b in range(32):
                want = before[(g, moved[b])] if b in moved else before[(g, b)]
                assert r.value(g, b) == want, (g, b)


def test_a_hybrid_load_leaves_memory_exactly_as_the_host_path_does():
    store = MemoryStore()
    h = hashes("hybrid", 6)
    with rank(store, groups=HYBRID, device=False) as writer:
        writer.fill(9)
        writer.save(h, [[0, 1, 2, 3, 4, 5]] * 3)
    targets = [[6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25]]
    with rank(store, groups=HYBRID) as dev, rank(store, groups=HYBRID, device=False) as host:
        dev.fill(4)
        host.fill(4)
        a, b = dev.load(h, targets), host.load(h, targets)
        assert (a.loaded, a.failures) == (b.loaded, b.failures) and a.loaded > 0
        assert bytes(dev.segment.buf) == bytes(host.segment.buf)


def test_a_request_larger_than_staging_moves_in_rounds():
    store = MemoryStore()
    # 4 layers x 4 KiB = 16 KiB a value: a slot's 64 KiB of staging holds 4, its bounce 2; 20 blocks take rounds.
    with rank(store, staging_bytes=4 * 64 * KiB, bounce_bytes=4 * 32 * KiB) as r:
        r.fill(3)
        h = hashes("big", 20)
        assert r.save(h, [list(range(20))]).written == 20
        originals = [r.value(0, b) for b in range(20)]
        out = r.load(h, [list(range(12, 32))])
        assert (out.loaded, out.failures) == (20, ())
        assert [r.value(0, b) for b in range(12, 32)] == originals


def test_a_value_that_was_not_read_is_never_scattered():
    store = MemoryStore()
    with rank(store) as r:
        r.fill(5)
        h = hashes("f", 4)
        r.save(h, [[0, 1, 2, 3]])
        r.fill(6)  # what a failed load must leave in place
        untouched = [r.value(0, b) for b in (10, 11, 12, 13)]
        failing = [k for k in store.keys() if k.endswith((h[1].hex(), h[2].hex()))]
        assert len(failing) == 2
        store.fail_keys(StoreCode.TRANSFER_FAILED, failing, ["get"])
        out = r.load(h, [[10, 11, 12, 13]])
        assert out.loaded == 2
        assert sorted(f.block_id for f in out.failures) == [11, 12]
        assert {f.reason for f in out.failures} == {Reason.of(StoreCode.TRANSFER_FAILED)}
        assert r.value(0, 11) == untouched[1] and r.value(0, 12) == untouched[2]
        assert r.value(0, 10) != untouched[0] and r.value(0, 13) != untouched[3]


def test_failed_puts_are_per_value():
    store = MemoryStore()
    with rank(store) as r:
        r.fill(2)
        h = hashes("p", 3)
        store.fail_next(StoreCode.NO_SPACE, 1, ["put"])
        out = r.save(h, [[0, 1, 2]])
        assert out.written == 2 and [f.block_id for f in out.failures] == [0]


def test_a_block_outside_the_region_is_refused_before_anything_moves():
    store = MemoryStore()
    with rank(store) as r:
        with pytest.raises(BadRequest, match="block id 40 is outside region 0"):
            r.save(hashes("x", 2), [[0, 40]])
        assert store.keys() == []


def test_a_value_larger_than_the_staging_area_is_refused_at_registration():
    with pytest.raises(BadRequest, match="raise --gpu-staging-size"), rank(MemoryStore(), staging_bytes=4 * 8 * KiB):
        pass


class Recording(Cpu):
    """A CPU standing in for a GPU that records what each slot's stream was asked, and can be made to fail like a
    GPU whose context hit a sticky error (every wait then raises CUDA's error, and so does a probe)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.waits: list[object] = []  # the stream of each synchronize, in order
        self.sticky = ""

    def stream(self) -> object:
        return object()  # one per slot

    def synchronize(self, stream: object) -> None:
        self.waits.append(stream)
        if self.sticky:
            raise RuntimeError(f"CUDA error: {self.sticky}")

    def broken(self, exc: BaseException) -> str:
        return f"cpu: {self.sticky}" if self.sticky and cuda_error(exc) else ""


class CrashingPuts(MemoryStore):
    """The in-memory store, its put failing with something no store error covers (a crashed native call)."""

    crash = True

    def put_from(self, keys, addresses, sizes, *, device=False, pin=None):  # type: ignore[no-untyped-def]
        if self.crash:
            raise RuntimeError("put crashed")
        return super().put_from(keys, addresses, sizes, device=device, pin=pin)


def test_a_request_that_fails_midway_still_waits_for_its_slot_and_gives_it_back():
    store, device = CrashingPuts(), Recording()
    with rank(store, accelerator=device) as r:
        r.fill(1)
        area = r.runtime.area("cpu")  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="put crashed"):
            r.save(hashes("crash", 4), [[0, 1, 2, 3]])
        # The gathers it queued were waited for before the slot went back, though the request failed.
        assert area.free == SLOTS and device.waits[-1] in {slot.stream for slot in area.slots}
        store.crash = False
        assert r.save(hashes("crash", 4), [[0, 1, 2, 3]]).written == 4


def test_a_load_waits_for_its_stream_once_and_a_save_once_per_round():
    store, device = MemoryStore(), Recording()
    # 16 KiB values; a slot's staging holds 4: 10 blocks are 3 rounds.
    with rank(store, accelerator=device, staging_bytes=4 * 64 * KiB, bounce_bytes=4 * 64 * KiB) as r:
        r.fill(2)
        h = hashes("waits", 10)
        assert r.save(h, [list(range(10))]).written == 10
        assert len(device.waits) == 3 + 1  # one before each round's put, one as the slot goes back
        device.waits.clear()
        # Through the bounce (the in-memory store has no segment): one wait per round before the bounce is
        # read again (64 KiB: 4 values), and none for block ids, which go up without the host waiting.
        assert r.load(h, [list(range(20, 30))]).loaded == 10
        assert len(device.waits) == 3 + 1


def test_a_sticky_cuda_error_fails_the_gpu_path_and_every_later_request_with_the_reason():
    store, device = MemoryStore(), Recording()
    with rank(store, accelerator=device) as r:
        r.fill(3)
        h = hashes("sticky", 2)
        assert r.save(h, [[0, 1]]).written == 2
        device.sticky = "an illegal memory access was encountered"
        with pytest.raises(DeviceUnavailable, match="GPU path failed \\(cpu: an illegal memory access was encount"):
            r.load(h, [[4, 5]])
        assert r.runtime is not None and r.runtime.failure == "cpu: an illegal memory access was encountered"
        assert r.runtime.describe().startswith("FAILED (cpu: an illegal memory access")
        assert r.metrics.registry.get_sample_value("kvsidecar_gpu_failed") == 1
        device.sticky = ""  # even if the device answered again: the path stays failed until a restart
        keys = store.keys()
        with pytest.raises(DeviceUnavailable, match="restart the daemon"):
            r.save(hashes("after", 2), [[6, 7]])
        assert store.keys() == keys
        with pytest.raises(DeviceUnavailable):
            r.runtime.area("cpu")  # what registering memory on it asks first
        # The error the request hit is its own, and was not taken for a sticky one: a CPU raises no CUDA errors.
        assert not Recording().broken(RuntimeError("put crashed"))


def test_loads_and_saves_of_one_gpu_overlap():
    # A save holding a slot through a slow put (a store busy for seconds) does not hold a load of the same GPU.
    store = SlowPuts()
    with rank(store) as r:
        r.fill(4)
        h = hashes("overlap", 4)
        assert r.save(h, [[0, 1, 2, 3]]).written == 4
        store.hold = True
        saving = threading.Thread(target=r.save, args=(hashes("held", 2), [[8, 9]]))
        saving.start()
        try:
            assert store.entered.wait(30)
            loaded: list[int] = []
            loading = threading.Thread(target=lambda: loaded.append(r.load(h, [[12, 13, 14, 15]]).loaded))
            loading.start()
            loading.join(20)
            assert loaded == [4], "the load waited for the save's put"
        finally:
            store.release.set()
            saving.join(30)


class SlowPuts(MemoryStore):
    """The in-memory store, holding each put while `hold` is set until `release` (a busy store's put)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def put_from(self, keys, addresses, sizes, *, device=False, pin=None):  # type: ignore[no-untyped-def]
        if self.hold:
            self.entered.set()
            self.release.wait(60)
        return super().put_from(keys, addresses, sizes, device=device, pin=pin)


def test_device_memory_is_not_registered_with_the_store_only_the_staging_it_reads_from():
    store = MemoryStore(require_registration=True)
    with rank(store) as r:
        mapping = next(iter(r.session.require_memory().mappings.values()))
        with pytest.raises(StoreError, match="no buffer registered"):
            store.unregister_buffer(mapping.address)  # never registered: no transfer of the store's reads it
        r.fill(5)
        h = hashes("registered", 3)
        assert r.save(h, [[0, 1, 2]]).written == 3  # from registered staging
        assert r.load(h, [[4, 5, 6]]).loaded == 3  # into the registered bounce
