"""Checksums through both movers over the in-memory store: what a save writes, and what a load does with bytes that
are not the ones saved (a value the store serves through the device path's bounce here; the segment's own copies
are tests/integration/test_checksums.py's, over a real Mooncake)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from kvsidecar.movers.trailer import TRAILER_BYTES, ChecksumSettings, chosen, digest, sealed
from kvsidecar.reasons import Reason
from kvsidecar.store import StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar_contract.placement import save_plan
from support.devicepath import BLOCK_TOKENS, Rank, hashes, rank

PATHS = pytest.mark.parametrize("device", [False, True], ids=["host path", "device path"])


def keys_of(r: Rank, h: list[bytes]) -> list[str]:
    plan = save_plan(r.session.geometry, h, [list(range(len(h)))], len(h) * BLOCK_TOKENS)
    return [c.key for c in plan.chunks]


def count(r: Rank, outcome: str) -> float:
    return r.metrics.registry.get_sample_value("kvsidecar_value_checksums_total", {"outcome": outcome}) or 0.0


def overwrite(store: MemoryStore, key: str, value: bytes) -> None:
    """Another writer's bytes under key (Mooncake's upsert, in the in-memory store: remove, then put)."""
    buffer = bytearray(value)
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    assert store.remove([key]) == [StoreCode.OK]
    assert store.put_from([key], [[address]], [[len(buffer)]]) == [StoreCode.OK]


@PATHS
def test_every_value_carries_the_sum_of_its_bytes_and_a_changed_byte_is_recomputed_never_served(device, caplog):
    store = MemoryStore()
    with rank(store, device=device, checksums=ChecksumSettings("all")) as r:
        r.fill(5)
        h = hashes("sums", 4)
        assert r.save(h, [[0, 1, 2, 3]]).written == 4
        keys = keys_of(r, h)
        for block, key in enumerate(keys):
            value = r.value(0, block)
            assert store.value(key) == value + sealed(digest(key, [memoryview(value)]))
        assert count(r, "summed") == 4
        # Another writer's bytes under key 1 and key 3, with the trailers they had: the sum no longer matches.
        for key in (keys[1], keys[3]):
            stored = bytearray(store.value(key) or b"")
            stored[100] ^= 0x40
            overwrite(store, key, bytes(stored))
        originals = [r.value(0, b) for b in range(4)]
        with caplog.at_level(logging.WARNING, logger="kvsidecar.datapath.accounting"):
            out = r.load(h, [[8, 9, 10, 11]])
        assert out.loaded == 2 and [(f.block_id, f.reason) for f in out.failures] == [
            (9, Reason.CHECKSUM_MISMATCH),
            (11, Reason.CHECKSUM_MISMATCH),
        ]
        assert [r.value(0, b) for b in (8, 10)] == [originals[0], originals[2]]
        # Counted, logged once for the request with its first key, and removed: the engine's recompute saves again.
        assert (count(r, "verified"), count(r, "mismatch")) == (4, 2)
        failed = r.metrics.registry.get_sample_value(
            "kvsidecar_load_failed_blocks_total", {"group_kind": "full_attention", "reason": "checksum_mismatch"}
        )
        assert failed == 2
        lines = [rec.getMessage() for rec in caplog.records if "checksum" in rec.getMessage()]
        assert len(lines) == 1 and keys[1] in lines[0] and "2 values read failed their checksum" in lines[0]
        assert store.value(keys[1]) is None and store.value(keys[3]) is None
        assert r.save(h, [[0, 1, 2, 3]]).written == 2
        assert r.load(h, [[8, 9, 10, 11]]).failures == ()
        assert [r.value(0, b) for b in (8, 9, 10, 11)] == originals


@PATHS
def test_bytes_not_of_a_writer_of_ours_under_a_chosen_key_are_never_served(device):
    store = MemoryStore()
    with rank(store, device=device, checksums=ChecksumSettings("all")) as r:
        r.fill(6)
        h = hashes("raw", 2)
        assert r.save(h, [[0, 1]]).written == 2
        keys = keys_of(r, h)
        size = len(r.value(0, 0))
        overwrite(store, keys[0], bytes(size + TRAILER_BYTES))  # the right size, zeros for a trailer
        overwrite(store, keys[1], r.value(0, 1))  # the block's own bytes, without a trailer
        out = r.load(h, [[4, 5]])
        assert [(f.block_id, f.reason) for f in out.failures] == [
            (4, Reason.CHECKSUM_MISMATCH),
            (5, Reason.SIZE_MISMATCH),
        ]


@PATHS
def test_sampled_one_value_in_n_carries_a_trailer_chosen_by_its_key(device):
    store = MemoryStore()
    with rank(store, device=device, checksums=ChecksumSettings("sampled", 4), blocks=32) as r:
        r.fill(7)
        h = hashes("sampled", 16)
        assert r.save(h, [list(range(16))]).written == 16
        keys = keys_of(r, h)
        picked = [k for k in keys if chosen(k, 4)]
        assert 0 < len(picked) < 16
        for block, key in enumerate(keys):
            value = r.value(0, block)
            stored = store.value(key)
            assert stored == (value + sealed(digest(key, [memoryview(value)])) if key in picked else value)
        assert count(r, "summed") == len(picked)
        out = r.load(h, [list(range(16, 32))])
        assert (out.loaded, out.failures) == (16, ())
        assert [r.value(0, b) for b in range(16, 32)] == [r.value(0, b) for b in range(16)]
        assert count(r, "verified") == len(picked)


def test_off_writes_plain_values_and_sums_nothing():
    store = MemoryStore()
    with rank(store, device=False, checksums=ChecksumSettings("off")) as r:
        r.fill(8)
        h = hashes("off", 4)
        assert r.save(h, [[0, 1, 2, 3]]).written == 4
        assert [store.value(k) for k in keys_of(r, h)] == [r.value(0, b) for b in range(4)]
        assert r.load(h, [[4, 5, 6, 7]]).loaded == 4
        assert count(r, "summed") == count(r, "verified") == 0
