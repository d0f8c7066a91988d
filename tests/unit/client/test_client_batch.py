"""The client's batches: cut to the daemon's limits, answers matched by name, each item's error its own."""

from __future__ import annotations

import grpc

from kvsidecar_client import DaemonError, InvalidRequest, LoadResult, PermissionDenied, SaveResult
from kvsidecar_client.batch import LoadItem, SaveItem, item_outcomes, load_items, parts, save_items
from kvsidecar_client.results import Hit
from kvsidecar_contract.batches import Batch
from kvsidecar_contract.limits import MAX_BATCH_ITEMS, MAX_HASHES
from kvsidecar_contract.proto import sidecar_pb2 as pb


def ids_of(block_ids):
    return [pb.BlockIds(ids=ids) for ids in block_ids]


def test_batches_are_cut_at_the_item_and_hash_limits_keeping_order():
    small = Batch(
        pb.SaveItem(name=str(i), request=pb.SaveRequest(block_hashes=[b"h"])) for i in range(MAX_BATCH_ITEMS + 3)
    )
    cut = parts(small)
    assert [len(c.open()) for c in cut] == [MAX_BATCH_ITEMS, 3]
    assert [item.name for c in cut for item in c.open()] == [str(i) for i in range(MAX_BATCH_ITEMS + 3)]
    half = [b"h"] * (MAX_HASHES // 2 + 1)
    big = Batch(pb.SaveItem(name=n, request=pb.SaveRequest(block_hashes=half)) for n in "abc")
    assert [[item.name for item in c.open()] for c in parts(big)] == [["a"], ["b"], ["c"]]
    assert parts(Batch()) == []


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

    saves = save_items(
        [SaveItem("ok", [b"h" * 32], [[1]], 16), SaveItem("groups", [b"h" * 32], [[1], [2]], 16),
         SaveItem("negative", [b"h" * 32], [[1]], -1)],
        block_ids,
    )  # fmt: skip
    (ok,) = saves.open()  # the others are answered with their refusals: nothing is sent for them
    assert ok.name == "ok" and list(ok.request.block_ids[0].ids) == [1]
    saves.answer([SaveResult(1, 0, 0, 0, 4)])
    _, groups, negative = saves.outcomes()
    assert isinstance(groups, InvalidRequest)
    assert isinstance(negative, InvalidRequest) and "negative" in negative.reason
    hit = Hit(16, (16,))
    loads = load_items(
        [LoadItem("hit", [b"h" * 32], [[3]], hit), LoadItem("miss", [b"h" * 32], [[3]], Hit(0, (0,))),
         LoadItem("groups", [b"h" * 32], [[3], [4]], hit)],
        block_ids,
    )  # fmt: skip
    (to_read,) = loads.open()
    assert to_read.name == "hit" and to_read.request.hit_tokens == 16 and not to_read.request.carried_groups
    loads.answer([LoadResult(1, 4)])
    _, miss, groups = loads.outcomes()
    assert miss == LoadResult(0, 0, ())
    assert isinstance(groups, InvalidRequest)
    (one_group,) = load_items([LoadItem("g", [b"h" * 32], [[3]], hit, groups=(0,))], block_ids).open()
    assert list(one_group.request.carried_groups) == [0]
