"""The service over a real socket with the in-memory store: store failures never become hits or wrong bytes."""

from __future__ import annotations

import time

import pytest

from kvsidecar.store import StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.waiting import wait_until
from support.inprocess import InProcessDaemon
from support.rawrank import RawRank, group, open_request

H = [bytes([i]) * 32 for i in range(1, 9)]
BLOCK = 1024


@pytest.fixture
def rank(daemon):
    r = RawRank(daemon.target, open_request([group("full_attention", 16), group("mamba", 16)]), block_bytes=BLOCK)
    r.register()
    for g in range(2):
        for b in range(4):
            r.fill_block(g, b, bytes([16 * g + b + 1]) * BLOCK)
    yield r
    r.close()


def test_store_down_during_lookup_is_a_degraded_miss(daemon, store, rank):
    assert rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64).written == 8
    assert rank.lookup(H[:4], 65).hit_tokens == 64

    def down(op, key):
        raise StoreUnavailable("master unreachable")

    store.set_fault(down)
    hit = rank.lookup(H[:4], 65)
    assert (hit.hit_tokens, hit.degraded, list(hit.tail_boundaries)) == (0, True, [0, 0])
    assert "master unreachable" in hit.detail
    assert daemon.sample("kvsidecar_lookup_requests_total", {"outcome": "degraded"}) == 1
    store.set_fault(None)
    assert rank.lookup(H[:4], 65).hit_tokens == 64


def test_unknown_probe_results_are_misses(store, rank):
    rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    mamba_key = next(k for k in store.keys() if ".g1@" in k and k.endswith(H[3].hex()))
    store.fail_keys(StoreCode.RPC_TIMEOUT, [mamba_key], ["exists"])
    assert rank.lookup(H[:4], 65).hit_tokens == 48


def test_failed_puts_are_counted_and_named(daemon, store, rank):
    store.fail_next(StoreCode.NO_SPACE, count=3, operations=["put"])
    out = rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    assert (out.written, out.failed) == (5, 3)
    assert {(f.group, f.block_id, f.reason) for f in out.failures} == {
        (0, 0, "no_space"),
        (0, 1, "no_space"),
        (0, 2, "no_space"),
    }
    assert (
        daemon.sample("kvsidecar_save_failed_blocks_total", {"group_kind": "full_attention", "reason": "no_space"}) == 3
    )
    # Right after a full store, saves back off: they fail at once without a put (the store is evicting).
    puts = []
    store.set_fault(lambda op, key: puts.append(key) if op == "put" else None)
    during = rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    assert (during.written, during.skipped, during.failed, puts) == (0, 5, 3, [])
    # Lookups and loads do not back off.
    assert rank.lookup(H[:4], 65).hit_tokens == 0  # block 0 of attention is missing
    backoff = daemon.daemon.dispatcher.handlers.datapath.backoff
    wait_until(lambda: not backoff.active(), timeout=30, what="the saves' backoff after a full store ended")
    # After the backoff a save writes what failed (existence check first, so nothing is written twice).
    again = rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    assert (again.written, again.skipped, again.failed) == (3, 5, 0)
    assert rank.lookup(H[:4], 65).hit_tokens == 64


def test_whole_put_failure_fails_every_block(store, rank):
    def down(op, key):
        if op == "put":
            raise StoreUnavailable("transfer engine closed")
        return None

    store.set_fault(down)
    out = rank.save(H[:2], [[0, 1]] * 2, 32)
    assert (out.written, out.failed) == (0, 4)
    assert {f.reason for f in out.failures} == {"unavailable"}


def test_failed_gets_name_exactly_their_blocks_and_nothing_else_is_touched(daemon, store, rank):
    rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    hit = rank.lookup(H[:4], 65)
    broken = next(k for k in store.keys() if ".g0@" in k and k.endswith(H[1].hex()))
    store.fail_keys(StoreCode.TRANSFER_FAILED, [broken], ["get"])
    for b in range(4, 8):
        rank.fill_block(0, b, b"\xee" * BLOCK)
    out = rank.load(H[:4], [[4, 5, 6, 7], [4, 5, 6, 7]], hit)
    assert [(f.group, f.block_id, f.reason) for f in out.failures] == [(0, 5, "transfer_failed")]
    assert out.loaded == 4
    assert rank.block(0, 4) == bytes([1]) * BLOCK
    assert rank.block(0, 6) == bytes([3]) * BLOCK
    assert rank.block(1, 7) == bytes([16 + 4]) * BLOCK
    assert (
        daemon.sample(
            "kvsidecar_load_failed_blocks_total", {"group_kind": "full_attention", "reason": "transfer_failed"}
        )
        == 1
    )


def test_a_value_of_the_wrong_size_is_a_failure_not_bytes(tmp_path, store, daemon, rank):
    rank.save(H[:1], [[0], [0]], 16)
    hit = rank.lookup(H[:1], 17)
    # Another daemon on the same store (one daemon refuses a second shape under a live namespace itself).
    (tmp_path / "elsewhere").mkdir()
    elsewhere = InProcessDaemon(tmp_path / "elsewhere", store, allow_shm_names=True).start()
    other = RawRank(
        elsewhere.target, open_request([group("full_attention", 16), group("mamba", 16)]), block_bytes=BLOCK // 2
    )
    try:
        other.register()
        out = other.load(H[:1], [[1], [1]], hit)
        assert {f.reason for f in out.failures} == {"size_mismatch"}
        assert out.loaded == 0
    finally:
        other.close()
        elsewhere.stop()


def test_concurrent_save_race_reported_as_written(store, rank):
    store.fail_next(StoreCode.EXISTS, count=1, operations=["put"])
    out = rank.save(H[:1], [[0], [0]], 16)
    assert (out.written, out.failed) == (2, 0)


def test_scheduler_lookup_without_memory(daemon, rank):
    rank.save(H[:4], [[0, 1, 2, 3]] * 2, 64)
    sched = RawRank(
        daemon.target, open_request([group("full_attention", 16), group("mamba", 16)], role=pb.ROLE_SCHEDULER)
    )
    try:
        assert sched.lookup(H[:4], 65, eagle=True).hit_tokens == 48
    finally:
        sched.close()


def test_a_save_that_outlives_its_deadline_leaves_nothing_to_serve(daemon, store, rank):

    import grpc

    def slow_put(op, key):
        if op == "put":
            time.sleep(0.2)  # per key: the put runs well past the client's deadline
        return None

    store.set_fault(slow_put)
    req = pb.SaveRequest(
        session_id=rank.session, block_hashes=H[:4], block_ids=[pb.BlockIds(ids=[0, 1, 2, 3])] * 2, num_tokens=64
    )
    with pytest.raises(grpc.RpcError) as err:
        rank.stub.Save(req, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The engine may reuse the blocks now; whatever the daemon read after the deadline must not be served.
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and daemon.sample(
            "kvsidecar_save_failed_blocks_total", {"group_kind": "full_attention", "reason": "deadline_exceeded"}
        )
        < 4
    ):
        time.sleep(0.1)
    store.set_fault(None)
    assert store.keys() == []
    assert rank.lookup(H[:4], 65).hit_tokens == 0


def test_no_block_spans_are_absent_from_saves_and_failed_in_loads(daemon, store, rank):
    no_block = 2**32 - 1
    out = rank.save(H[:4], [[0, 1, 2, 3], [no_block, no_block, no_block, 3]], 64)
    assert (out.written, out.absent, out.failed) == (5, 3, 0)
    hit = rank.lookup(H[:4], 65)
    assert hit.hit_tokens == 64  # the state at 64 was kept; the earlier ones are not needed for this hit
    loaded = rank.load(H[:4], [[4, 5, 6, 7], [no_block] * 4], hit)
    assert [(f.group, f.block_id, f.reason) for f in loaded.failures] == [(1, no_block, "no_block")]
    assert loaded.loaded == 4
    assert daemon.sample("kvsidecar_load_failed_blocks_total", {"group_kind": "mamba", "reason": "no_block"}) == 1
