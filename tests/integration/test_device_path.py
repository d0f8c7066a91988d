"""The device path over a real Mooncake client (a real master), a CPU standing in for the GPU: loads copy each
value straight from its replica in this process's segment (the store says where, with a read lease), adjacent
replicas at once; what is not in the segment comes through the store; the disk tier writes a device save behind
from the DRAM replica, since nothing on the CPU can read device memory."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.movers.device import DeviceMover
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.store import StoreCode
from kvsidecar.store.mooncake_store import MooncakeStore
from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.tiered import TieredStore
from kvsidecar_contract.placement import GroupSpec, Kind
from support.devicepath import KiB, hashes, rank

pytestmark = pytest.mark.integration
MiB = 1 << 20


@pytest.fixture(scope="module")
def node_store(mooncake_client_env, mooncake_settings) -> Iterator[MooncakeStore]:  # type: ignore[no-untyped-def]
    """A store alone on a master of its own, as a daemon is on its node: every replica lands in its own segment.

    On the session's shared master, other tests' clients hold segments too and Mooncake places a put's replica in
    any of them (measured: 2 of 12 landed in the putting client's segment with three clients mounted), so what these
    tests check (copies straight from this process's segment) would hold only by chance.
    """
    master = EmbeddedMaster().start()
    store = MooncakeStore.connect(mooncake_settings(master))
    try:
        yield store
    finally:
        store.close()
        master.stop()


@pytest.fixture
def mooncake_store(node_store: MooncakeStore, key_prefix: str) -> Iterator[MooncakeStore]:
    """This module's node store; keys under key_prefix are removed after the test."""
    yield node_store
    node_store.remove_prefix(key_prefix)


def test_the_store_locates_replicas_in_its_own_segment_only(mooncake_store, key_prefix):
    segment = mooncake_store.segment()
    assert segment is not None and segment.size >= 16 * MiB
    data = ctypes.create_string_buffer(b"v" * 4096)
    keys = [f"{key_prefix}{i}" for i in range(3)]
    assert mooncake_store.put_from(keys, [[ctypes.addressof(data)]] * 3, [[4096]] * 3) == [StoreCode.OK] * 3
    found = list(mooncake_store.locate([*keys, f"{key_prefix}absent"]))
    assert found[3] is None
    for replica in found[:3]:
        assert replica is not None and replica.size == 4096
        assert segment.address <= replica.address and replica.address + 4096 <= segment.address + segment.size
        assert ctypes.string_at(replica.address, 4096) == b"v" * 4096


class CountingGets:
    """The store, counting the values read through it (what the device path does NOT copy itself)."""

    def __init__(self, store):  # type: ignore[no-untyped-def]
        self._store = store
        self.read = 0

    def get_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.read += len(keys)
        return self._store.get_into(keys, addresses, sizes)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)


def test_a_device_load_copies_from_the_segment_and_every_byte_arrives(mooncake_store, key_prefix):
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16))
    counting = CountingGets(mooncake_store)
    with rank(counting, groups=groups, model=f"{key_prefix}m") as r:
        r.fill(11)
        h = hashes(key_prefix, 8)
        assert r.save(h, [list(range(8))] * 2).written == 16
        keys = [k for k in _keys(r, h)]
        assert None not in list(mooncake_store.locate(keys)), "the values are in this process's segment"
        originals = {(g, b): r.value(g, b) for g in range(2) for b in range(8)}
        out = r.load(h, [list(range(16, 24)), list(range(24, 32))])
        assert (out.loaded, out.failures) == (16, ())
        assert counting.read == 0, "every value was copied from its replica in the segment, none read by the store"
        for g, first in ((0, 16), (1, 24)):
            assert [r.value(g, first + b) for b in range(8)] == [originals[(g, b)] for b in range(8)]


def test_values_a_save_laid_side_by_side_come_back_in_one_copy(mooncake_store, key_prefix):
    # A block stored as one value per KV head (rule 11): a batch put lays each block's two values one after the other,
    # so no two values of one head are adjacent in the segment. Placed in staging in the order the request names
    # them, they are: the whole load is one host-to-device copy (one per value before), scattered as strided views.
    # (Without checksum trailers: a value with one takes a larger size class of the segment, and the value after it
    # starts a copy of its own.)
    with rank(mooncake_store, heads=2, model=f"{key_prefix}m", checksums=ChecksumSettings("off")) as r:
        r.fill(13)
        h = hashes(key_prefix, 8)
        assert r.save(h, [list(range(8))]).written == 16
        originals = [r.value(0, b) for b in range(8)]
        mover = r.session.require_mover()
        assert isinstance(mover, DeviceMover)
        before = mover.copies
        out = r.load(h, [list(range(16, 24))])
        assert (out.loaded, out.failures) == (16, ())
        assert mover.copies - before == 1
        assert [r.value(0, b) for b in range(16, 24)] == originals


def test_values_smaller_than_an_index_entry_move_in_rounds_of_the_index_buffer(mooncake_store, key_prefix):
    # 64-byte values: a 1 KiB slot holds 16 of them but has index room for 4 block ids (one per 256 bytes).
    with rank(mooncake_store, block_bytes=16, staging_bytes=4 * KiB, bounce_bytes=4 * KiB, model=f"{key_prefix}m") as r:
        r.fill(14)
        h = hashes(key_prefix, 10)
        assert r.save(h, [list(range(10))]).written == 10
        originals = [r.value(0, b) for b in range(10)]
        out = r.load(h, [list(range(20, 30))])
        assert (out.loaded, out.failures) == (10, ())
        assert [r.value(0, b) for b in range(20, 30)] == originals


def test_a_device_save_is_written_behind_from_the_dram_replica(mooncake_store, key_prefix, tmp_path):
    disk = DiskEngine(tmp_path, 64 * MiB, queue_bytes=16 * MiB, file_size=4 * MiB)
    store = TieredStore(mooncake_store, disk)
    try:
        with rank(store, model=f"{key_prefix}m") as r:
            r.fill(12)
            h = hashes(key_prefix, 4)
            assert r.save(h, [[0, 1, 2, 3]]).written == 4
            assert disk.flush(30)
            originals = [r.value(0, b) for b in range(4)]
            # Gone from DRAM: the load finds nothing in the segment and reads the disk into the bounce.
            assert mooncake_store.remove(_keys(r, h)) == [StoreCode.OK] * 4
            out = r.load(h, [[8, 9, 10, 11]])
            assert (out.loaded, out.failures) == (4, ())
            assert [r.value(0, b) for b in (8, 9, 10, 11)] == originals
    finally:
        disk.close()


def _keys(r, h):  # type: ignore[no-untyped-def]
    from kvsidecar_contract.placement import save_plan

    plan = save_plan(r.session.geometry, h, [list(range(len(h)))] * len(r.session.layout.groups), len(h) * 16)
    return [c.key for c in plan.chunks]
