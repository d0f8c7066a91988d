"""SaveBatch and LoadBatch over a real socket with the in-memory store: every item answered on its own, by name."""

from __future__ import annotations

import grpc
import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.rpc import wire
from kvsidecar.store import StoreCode
from kvsidecar_contract.limits import MAX_BATCH_ITEMS, MAX_HASHES
from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.rawrank import RawRank, group, open_request

BLOCK = 1024
U = 16


def hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(1, n + 1)]


def save_item(name: str, h: list[bytes], ids: list[int], num_tokens: int | None = None) -> pb.SaveItem:
    request = pb.SaveRequest(
        block_hashes=h, block_ids=[pb.BlockIds(ids=ids)], num_tokens=len(h) * U if num_tokens is None else num_tokens
    )
    return pb.SaveItem(name=name, request=request)


def load_item(name: str, h: list[bytes], ids: list[int], hit: pb.LookupResponse) -> pb.LoadItem:
    request = pb.LoadRequest(
        block_hashes=h,
        block_ids=[pb.BlockIds(ids=ids)],
        hit_tokens=hit.hit_tokens,
        tail_boundaries=list(hit.tail_boundaries),
    )
    return pb.LoadItem(name=name, request=request)


@pytest.fixture
def rank(daemon):
    r = RawRank(daemon.target, open_request([group("full_attention", U)]), num_blocks=16, block_bytes=BLOCK)
    r.register()
    for b in range(16):
        r.fill_block(0, b, bytes([b + 1]) * BLOCK)
    yield r
    r.close()


def test_items_are_answered_in_order_by_name_and_a_bad_item_fails_alone(daemon, rank):
    good, other, short = hashes(1, 2), hashes(2, 1), [b"\x09" * 7]
    items = [
        save_item("good", good, [0, 1]),
        save_item("short-hash", short, [2]),
        save_item("past-the-cache", hashes(4, 1), [99]),
        save_item("bad-tokens", hashes(5, 1), [3], num_tokens=5 * U),  # more tokens than its hashes cover
        save_item("other", other, [4]),
    ]
    answer = rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session, items=items), timeout=30)
    assert [r.name for r in answer.results] == [i.name for i in items]
    by_name = {r.name: r for r in answer.results}
    assert by_name["good"].WhichOneof("outcome") == "response"
    assert (by_name["good"].response.written, by_name["good"].response.failed) == (2, 0)
    assert by_name["other"].response.written == 1
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for name, says in (
        ("short-hash", "block hash 0 has 7 bytes"),
        ("past-the-cache", "99"),
        ("bad-tokens", ""),
    ):
        result = by_name[name]
        assert result.WhichOneof("outcome") == "error", name
        assert result.error.code == invalid, (name, result.error)
        assert says in result.error.reason, (name, result.error.reason)
    # Each refusal is counted like a lone call's, under the batch's method.
    assert daemon.sample("kvsidecar_requests_rejected_total", {"method": "SaveBatch", "code": "INVALID_ARGUMENT"}) == 3
    assert daemon.sample("kvsidecar_requests_total", {"method": "SaveBatch"}) == 1
    assert daemon.sample("kvsidecar_batch_items_total", {"method": "SaveBatch"}) == len(items)


def test_a_store_failure_is_named_in_its_own_items_result(store, rank):
    a, b = hashes(6, 2), hashes(7, 2)
    store.fail_next(StoreCode.TRANSFER_FAILED, count=1, operations=["put"])  # (NO_SPACE would back off the rest)
    items = [save_item("a", a, [0, 1]), save_item("b", b, [2, 3])]
    answer = rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session, items=items), timeout=30)
    first, second = (r.response for r in answer.results)
    assert (first.written, first.failed, [f.block_id for f in first.failures]) == (1, 1, [0])
    assert (second.written, second.failed) == (2, 0)

    hit_a, hit_b = rank.lookup(a, 2 * U + 1), rank.lookup(b, 2 * U + 1)
    assert (hit_a.hit_tokens, hit_b.hit_tokens) == (0, 2 * U)  # a's first block is missing: a misses
    store.fail_next(StoreCode.TRANSFER_FAILED, count=1, operations=["get"])
    loads = [load_item("b", b, [10, 11], hit_b), load_item("b-again", b, [12, 13], hit_b)]
    answer = rank.stub.LoadBatch(pb.LoadBatchRequest(session_id=rank.session, items=loads), timeout=30)
    one, two = (r.response for r in answer.results)
    assert (one.loaded, [(f.block_id, f.reason) for f in one.failures]) == (1, [(10, "transfer_failed")])
    assert (two.loaded, list(two.failures)) == (2, [])
    assert rank.block(0, 11) == rank.block(0, 3) and rank.block(0, 12) == rank.block(0, 2)


def test_an_empty_batch_is_an_empty_answer_and_repeated_names_refuse_the_batch(rank):
    empty = rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session), timeout=30)
    assert list(empty.results) == []
    item = save_item("a", hashes(9, 1), [0])
    with pytest.raises(grpc.RpcError) as twice:
        rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session, items=[item, item]), timeout=30)
    assert twice.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'a' appears more than once" in (twice.value.details() or "")
    assert rank.lookup(hashes(9, 1), U + 1).hit_tokens == 0  # nothing of a refused batch is written


def test_session_errors_fail_the_whole_batch(daemon):
    item = save_item("a", hashes(8, 1), [0])
    no_memory = RawRank(daemon.target, open_request([group("full_attention", U)]), block_bytes=BLOCK)
    scheduler = RawRank(daemon.target, open_request([group("full_attention", U)], role=pb.ROLE_SCHEDULER))
    try:
        for rank, code in (
            (no_memory, grpc.StatusCode.FAILED_PRECONDITION),
            (scheduler, grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session, items=[item]), timeout=30)
            assert refused.value.code() is code
        with pytest.raises(grpc.RpcError) as unknown:
            no_memory.stub.LoadBatch(pb.LoadBatchRequest(session_id="gone", items=[]), timeout=30)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
        # Even an empty batch: whether a session may save or load does not depend on its items.
        with pytest.raises(grpc.RpcError) as empty:
            no_memory.stub.LoadBatch(pb.LoadBatchRequest(session_id=no_memory.session), timeout=30)
        assert empty.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        no_memory.close()
        scheduler.close()


def test_batch_limits_hold_for_the_items_together():
    one = pb.SaveItem(name="a", request=pb.SaveRequest(block_hashes=[b"x"]))
    with pytest.raises(BadRequest, match=f"at most {MAX_BATCH_ITEMS} items"):
        wire.batch_items([pb.SaveItem(name=str(i)) for i in range(MAX_BATCH_ITEMS + 1)], "SaveBatch")
    with pytest.raises(BadRequest, match="'a' appears more than once"):
        wire.batch_items([one, one], "SaveBatch")
    half = [b"h"] * (MAX_HASHES // 2 + 1)
    big = [pb.SaveItem(name=n, request=pb.SaveRequest(block_hashes=half)) for n in "ab"]
    with pytest.raises(BadRequest, match="block hashes per batch"):
        wire.batch_items(big, "SaveBatch")
    ids = [pb.BlockIds(ids=[0] * (MAX_HASHES // 2 + 1))]
    wide = [pb.LoadItem(name=n, request=pb.LoadRequest(block_ids=ids)) for n in "ab"]
    with pytest.raises(BadRequest, match="block ids per batch"):
        wire.batch_items(wide, "LoadBatch")
    assert wire.batch_items([one], "SaveBatch") == [one]


def test_item_errors_carry_the_status_code_number():
    error = wire.item_error(grpc.StatusCode.INVALID_ARGUMENT, "why")
    assert (error.code, error.reason) == (3, "why")
    assert wire.item_error(grpc.StatusCode.INTERNAL, "").code == 13


def test_one_key_in_two_items_is_put_once_and_read_into_both_blocks(store, rank):
    # Two requests of one step computed the same prefix: both save it, one value is written, both are told so.
    shared = hashes(10, 2)
    puts: list[str] = []
    store.set_fault(lambda op, key: puts.append(key) if op == "put" else None)
    items = [save_item("first", shared, [0, 1]), save_item("second", shared, [0, 1])]
    answer = rank.stub.SaveBatch(pb.SaveBatchRequest(session_id=rank.session, items=items), timeout=30)
    store.set_fault(None)
    assert [(r.response.written, r.response.failed) for r in answer.results] == [(2, 0), (2, 0)]
    assert len(puts) == len(set(puts)) == 2
    hit = rank.lookup(shared, 2 * U + 1)
    loads = [load_item("here", shared, [6, 7], hit), load_item("there", shared, [8, 9], hit)]
    answer = rank.stub.LoadBatch(pb.LoadBatchRequest(session_id=rank.session, items=loads), timeout=30)
    assert [(r.response.loaded, len(r.response.failures)) for r in answer.results] == [(2, 0), (2, 0)]
    assert rank.block(0, 6) == rank.block(0, 8) == rank.block(0, 0)
    assert rank.block(0, 7) == rank.block(0, 9) == rank.block(0, 1)
