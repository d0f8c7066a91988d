"""TieredStore: a DRAM store (the in-memory test store) with the real disk engine behind it, as one Store."""

from __future__ import annotations

import ctypes

import pytest

from kvsidecar.errors import StoreError
from kvsidecar.store.base import Presence
from kvsidecar.store.codes import StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.tiered import TieredStore

MiB = 1 << 20
VALUE = 64 << 10


class Block:
    def __init__(self, data: bytes = b"") -> None:
        self.raw = ctypes.create_string_buffer(data or VALUE, VALUE)
        self.address = ctypes.addressof(self.raw)

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, VALUE)


def value(tag: str) -> bytes:
    return (tag.encode() * (VALUE // len(tag) + 1))[:VALUE]


@pytest.fixture
def parts(tmp_path):
    dram = MemoryStore(capacity_bytes=2 * VALUE)
    disk = DiskEngine(tmp_path, 64 * MiB, queue_bytes=16 * MiB, file_size=4 * MiB)
    served: list[tuple[str, int]] = []
    store = TieredStore(dram, disk, lambda tiers, sizes: served.extend(zip(tiers, sizes, strict=True)))
    yield dram, disk, store, served
    store.close()


def put(store: TieredStore, key: str, data: bytes) -> StoreCode:
    block = Block(data)
    (code,) = store.put_from([key], [[block.address]], [[VALUE]])
    return code


def get(store: TieredStore, key: str, size: int = VALUE) -> tuple[StoreCode, bytes]:
    block = Block()
    (code,) = store.get_into([key], [[block.address]], [[size]])
    return code, block.bytes()


def test_every_value_is_written_behind_and_served_once_dram_lost_it(parts):
    dram, disk, store, served = parts
    # DRAM holds two values; the third and fourth do not fit there and go to disk alone, reported stored.
    assert [put(store, f"k{i}", value(f"v{i}")) for i in range(4)] == [StoreCode.OK] * 4
    assert dram.keys() == ["k0", "k1"]
    assert disk.flush(60)
    assert disk.contains([f"k{i}" for i in range(4)]) == [True] * 4
    assert store.exists(["k0", "k3", "nope"]) == [Presence.PRESENT, Presence.PRESENT, Presence.ABSENT]
    dram.remove(["k0"])  # as DRAM eviction would
    assert get(store, "k0") == (StoreCode.OK, value("v0"))
    assert get(store, "k1") == (StoreCode.OK, value("v1"))
    assert get(store, "k3") == (StoreCode.OK, value("v3"))
    # What served each get was told as it happened; where each value is now is a query of its own.
    assert served == [("disk", VALUE), ("memory", VALUE), ("disk", VALUE)]
    assert store.tiers(["k0", "k1", "k3", "nope"]) == ["disk", "memory", "disk", ""]
    assert store.readable("k0") and store.readable("k1") and not store.readable("nope")
    assert get(store, "nope")[0] is StoreCode.NOT_FOUND
    assert get(store, "k3", VALUE // 2)[0] is StoreCode.SIZE_MISMATCH


def test_a_full_dram_and_a_full_queue_refuse_the_save(tmp_path):
    dram = MemoryStore(capacity_bytes=VALUE)
    disk = DiskEngine(tmp_path, 64 * MiB, queue_bytes=VALUE - 1, file_size=4 * MiB)
    store = TieredStore(dram, disk)
    try:
        assert put(store, "in-dram", value("a")) is StoreCode.OK  # DRAM took it; the disk queue could not
        assert put(store, "nowhere", value("b")) is StoreCode.NO_SPACE
        assert disk.snapshot().skipped["queue_full"] == 2
        assert get(store, "in-dram") == (StoreCode.OK, value("a"))
    finally:
        store.close()


def test_a_failing_or_closed_dram_falls_back_to_disk(parts):
    dram, disk, store, _ = parts
    put(store, "k", value("k"))
    disk.flush(60)
    dram.fail_keys(StoreCode.TRANSFER_FAILED, ["k"], ["get"])
    assert get(store, "k") == (StoreCode.OK, value("k"))
    dram.set_fault(None)
    dram.close()  # every DRAM call raises StoreUnavailable now
    assert store.exists(["k", "other"]) == [Presence.PRESENT, Presence.UNKNOWN]
    assert get(store, "k") == (StoreCode.OK, value("k"))
    assert get(store, "other")[0] is StoreCode.UNAVAILABLE


def test_removal_reaches_both_tiers(parts):
    _, disk, store, _ = parts
    for key in ("t1/a", "t1/b", "t2/a"):
        put(store, key, value(key))
    disk.flush(60)
    assert store.remove(["t1/a", "absent"]) == [StoreCode.OK, StoreCode.NOT_FOUND]
    assert store.remove_prefix("t1/") == 1
    assert store.exists(["t1/a", "t1/b", "t2/a"]) == [Presence.ABSENT, Presence.ABSENT, Presence.PRESENT]
    assert get(store, "t1/b")[0] is StoreCode.NOT_FOUND


def test_health_carries_the_recovery_note(parts):
    _, _, store, _ = parts
    store.note_health("disk tier X: recovered 0 blocks on disk")
    health = store.health()
    assert health.healthy and health.detail.endswith("; disk tier X: recovered 0 blocks on disk")


def test_disk_only_asks_dram_nothing_until_the_window_ends(parts):
    dram, disk, store, served = parts
    assert put(store, "both", value("b")) is StoreCode.OK
    assert disk.flush(60)
    only_dram = Block(value("d"))
    assert dram.put_from(["dram"], [[only_dram.address]], [[VALUE]]) == [StoreCode.OK]  # never written to disk
    store.disk_only_for(600)  # a killed predecessor's segment may still be listed: DRAM is not read
    assert store.disk_only()
    assert store.exists(["both", "dram"]) == [Presence.PRESENT, Presence.ABSENT]
    assert store.tiers(["both", "dram"]) == ["disk", ""]
    assert not store.readable("dram") and store.readable("both")
    assert get(store, "both") == (StoreCode.OK, value("b"))
    assert served[-1] == ("disk", VALUE)  # from disk although DRAM holds it
    assert get(store, "dram")[0] is StoreCode.NOT_FOUND
    with pytest.raises(StoreError):
        store.get_into(["both"], [[1, 2]], [[VALUE]])  # bad shapes stay the caller's error
    assert put(store, "new", value("n")) is StoreCode.OK  # saves go on as always (DRAM is full: to disk alone)
    assert disk.flush(60) and disk.contains(["new"]) == [True]
    store.disk_only_for(0)
    assert not store.disk_only()
    assert store.exists(["dram"]) == [Presence.PRESENT]
    assert get(store, "dram") == (StoreCode.OK, value("d"))
    assert served[-1] == ("memory", VALUE)
