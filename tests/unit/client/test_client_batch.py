"""The client's batches: cut to the daemon's limits, answers matched by name, each item's error its own."""

from __future__ import annotations

import grpc

from kvsidecar_client import DaemonError, InvalidRequest, LoadResult, PermissionDenied, SaveResult
from kvsidecar_client.batch import LoadItem, SaveItem, chunks, item_outcomes, load_requests, save_requests
from kvsidecar_client.results import Hit
from kvsidecar_contract.limits import MAX_BATCH_ITEMS, MAX_HASHES
from kvsidecar_contract.proto import sidecar_pb2 as pb


def ids_of(block_ids):
    return [pb.BlockIds(ids=ids) for ids in block_ids]


def test_batches_are_cut_at_the_item_and_hash_limits_keeping_order():
    small = [(str(i), pb.SaveRequest(block_hashes=[b"h"]), i) for i in range(MAX_BATCH_ITEMS + 3)]
    cut = list(chunks(small))
    assert [len(c) for c in cut] == [MAX_BATCH_ITEMS, 3]
    assert [extra for c in cut for _, _, extra in c] == list(range(MAX_BATCH_ITEMS + 3))
    half = [b"h"] * (MAX_HASHES // 2 + 1)
    big = [(n, pb.SaveRequest(block_hashes=half), None) for n in "abc"]
    assert [[name for name, _, _ in c] for c in chunks(big)] == [["a"], ["b"], ["c"]]
    assert list(chunks([])) == []


def test_answers_are_matched_by_name_and_carry_each_items_own_error():
    results = [
        pb.SaveItemResult(name="a", response=pb.SaveResponse(written=2, bytes_written=8)),
        pb.SaveItemResult(name="b", error=pb.ItemError(code=grpc.StatusCode.PERMISSION_DENIED.value[0], reason="no")),
        pb.SaveItemResult(name="c", error=pb.ItemError(code=999, reason="from the future")),
    ]
    a, b, c = item_outcomes("SaveBatch", ["a", "b", "c"], results, SaveResult)
    assert isinstance(a, SaveResult) and (a.written, a.bytes_written) == (2, 8)
    assert isinstance(b, PermissionDenied) and (b.reason, b.method) == ("no", "SaveBatch")
    assert isinstance(c, DaemonError) and c.code is grpc.StatusCode.UNKNOWN
    # Results named otherwise than asked (or missing) trust none of them.
    for names in (["a", "c", "b"], ["a", "b"]):
        assert all(isinstance(o, DaemonError) for o in item_outcomes("SaveBatch", names, results, SaveResult))
    loads = [pb.LoadItemResult(name="x", response=pb.LoadResponse(loaded=1, failures=[pb.FailedBlock(block_id=4)]))]
    (x,) = item_outcomes("LoadBatch", ["x"], loads, LoadResult)
    assert isinstance(x, LoadResult) and x.failed_block_ids == {4}


def test_a_bad_item_is_refused_alone_and_a_miss_needs_no_call():
    def block_ids(ids):
        if len(ids) != 1:
            raise InvalidRequest("one group", method="SaveBatch")
        return ids_of(ids)

    saves = save_requests(
        [SaveItem("ok", [b"h" * 32], [[1]], 16), SaveItem("groups", [b"h" * 32], [[1], [2]], 16),
         SaveItem("negative", [b"h" * 32], [[1]], -1)],
        block_ids,
    )  # fmt: skip
    assert isinstance(saves["ok"], pb.SaveRequest) and list(saves["ok"].block_ids[0].ids) == [1]
    assert isinstance(saves["groups"], InvalidRequest)
    assert isinstance(saves["negative"], InvalidRequest) and "negative" in saves["negative"].reason
    hit = Hit(16, (16,))
    loads = load_requests(
        [LoadItem("hit", [b"h" * 32], [[3]], hit), LoadItem("miss", [b"h" * 32], [[3]], Hit(0, (0,))),
         LoadItem("groups", [b"h" * 32], [[3], [4]], hit)],
        block_ids,
    )  # fmt: skip
    assert isinstance(loads["hit"], pb.LoadRequest) and loads["hit"].hit_tokens == 16
    assert loads["miss"] == LoadResult(0, 0, ())
    assert isinstance(loads["groups"], InvalidRequest)
