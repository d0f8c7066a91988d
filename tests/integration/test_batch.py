"""SaveBatch and LoadBatch against a real daemon and a real mooncake_master: byte-exact, answered per request by name,
and a bad item fails alone while a session error fails the whole call."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from kvsidecar_client import (
    EngineLayout,
    InvalidRequest,
    LoadItem,
    SaveItem,
    SidecarClient,
    SidecarError,
    shared_tensor,
)
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto.sidecar_pb2_grpc import SidecarStub
from kvsidecar_testing.hashes import chained_hashes

pytestmark = pytest.mark.integration

U = 16
NUM_BLOCKS = 64


@pytest.fixture
def rank(daemon, key_prefix) -> Iterator[tuple[SidecarClient, torch.Tensor]]:
    kv = shared_tensor((NUM_BLOCKS, U, 64), torch.float16)
    client = SidecarClient.connect(
        daemon.target, model="org/Batched", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
        groups=[ClientGroup("full_attention", block_size=U)], cache_prefix=key_prefix,
    )  # fmt: skip
    try:
        client.register([kv], groups_of_tensor=[(0,)])
        yield client, kv
    finally:
        client.close()


def step(n: int, salt: str) -> list[tuple[str, list[bytes], list[int]]]:
    """n requests of 1-4 blocks each, on disjoint blocks: (name, hashes, block ids)."""
    out, next_block = [], 0
    for i in range(n):
        blocks = 1 + i % 4
        out.append((f"req-{i}", chained_hashes(f"{salt}/{i}", blocks), list(range(next_block, next_block + blocks))))
        next_block += blocks
    return out


def test_a_step_of_saves_and_loads_is_one_call_each_byte_exact_and_named_per_request(daemon, rank):
    client, kv = rank
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(14)))
    reqs = step(10, "step")  # 25 blocks
    before = daemon.requests_by_method()
    jobs = client.save_batch([SaveItem(name, h, [ids], len(h) * U) for name, h, ids in reqs])
    assert set(jobs) == {name for name, _, _ in reqs}
    for name, h, _ in reqs:
        result = jobs[name].result(timeout=60)
        assert (result.written, result.skipped, result.failed) == (len(h), 0, 0), name
    hits = {name: client.lookup(h, len(h) * U + 1) for name, h, _ in reqs}
    assert all(hits[name].hit_tokens == len(h) * U for name, h, _ in reqs)
    # Load every request into other blocks (the upper half of the cache), then compare bytes.
    loads = [LoadItem(name, h, [[b + NUM_BLOCKS // 2 for b in ids]], hits[name]) for name, h, ids in reqs]
    results = client.load_batch(loads)
    after = daemon.requests_by_method()
    assert set(results) == {name for name, _, _ in reqs}
    for name, h, ids in reqs:
        result = results[name]
        assert not isinstance(result, SidecarError), result
        assert (result.loaded, result.failures) == (len(h), ()), name
        for b in ids:
            assert torch.equal(kv[b + NUM_BLOCKS // 2].view(torch.uint8), kv[b].view(torch.uint8)), (name, b)
    assert after.get("SaveBatch", 0) - before.get("SaveBatch", 0) == 1
    assert after.get("LoadBatch", 0) - before.get("LoadBatch", 0) == 1
    assert after.get("Save", 0) == before.get("Save", 0) and after.get("Load", 0) == before.get("Load", 0)


def test_a_bad_item_fails_alone_with_its_own_reason(daemon, rank):
    client, kv = rank
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(15)))
    good = chained_hashes("alone/good", 2)
    short = [b"\x01" * 8, b"\x02" * 32]  # the session declared 32-byte hashes: the daemon refuses this item
    out_of_range = chained_hashes("alone/range", 1)
    jobs = client.save_batch(
        [
            SaveItem("short-hash", short, [[10, 11]], 2 * U),
            SaveItem("good", good, [[0, 1]], 2 * U),
            SaveItem("past-the-cache", out_of_range, [[NUM_BLOCKS + 5]], U),
            SaveItem("local-refusal", good, [[0], [1]], 2 * U),  # two groups' ids: refused by the client
        ]
    )
    assert jobs["good"].result(timeout=60).written == 2
    for name in ("short-hash", "past-the-cache", "local-refusal"):
        error = jobs[name].exception(timeout=60)
        assert isinstance(error, InvalidRequest), (name, error)
        assert error.code in (None, grpc.StatusCode.INVALID_ARGUMENT)
    short_error = jobs["short-hash"].exception()
    assert short_error is not None and "block hash 0 has 8 bytes" in short_error.reason
    past_error = jobs["past-the-cache"].exception()
    assert past_error is not None and str(NUM_BLOCKS + 5) in past_error.reason, past_error
    # Nothing of a refused item was stored; the good one is served whole.
    assert client.lookup(out_of_range, U + 1).hit_tokens == 0
    hit = client.lookup(good, 2 * U + 1)
    results = client.load_batch(
        [
            LoadItem("good", good, [[40, 41]], hit),
            LoadItem("short-hash", short, [[42, 43]], hit),
            LoadItem("nothing-to-read", out_of_range, [[44]], client.lookup(out_of_range, U + 1)),
        ]
    )
    good_load = results["good"]
    assert not isinstance(good_load, SidecarError) and good_load.loaded == 2
    assert torch.equal(kv[40:42].view(torch.uint8), kv[0:2].view(torch.uint8))
    assert isinstance(results["short-hash"], InvalidRequest)
    assert results["short-hash"].code is grpc.StatusCode.INVALID_ARGUMENT
    nothing = results["nothing-to-read"]
    assert not isinstance(nothing, SidecarError) and nothing.loaded == 0


def test_session_errors_fail_the_whole_batch(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        stub = SidecarStub(channel)
        item = pb.SaveItem(name="a", request=pb.SaveRequest(block_hashes=[b"\x00" * 32], num_tokens=U))
        with pytest.raises(grpc.RpcError) as unknown:
            stub.SaveBatch(pb.SaveBatchRequest(session_id="nope", items=[item]), timeout=30)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as unknown_load:
            stub.LoadBatch(pb.LoadBatchRequest(session_id="nope", items=[]), timeout=30)
        assert unknown_load.value.code() is grpc.StatusCode.NOT_FOUND
        # The session is asked first, as for a lone Save: a malformed batch of an unknown session is NOT_FOUND.
        with pytest.raises(grpc.RpcError) as twice:
            stub.SaveBatch(pb.SaveBatchRequest(session_id="nope", items=[item, item]), timeout=30)
        assert twice.value.code() is grpc.StatusCode.NOT_FOUND


def test_requests_of_a_step_sharing_a_prefix_each_get_its_bytes(daemon, rank):
    # Mooncake's batch get fills only the last of a key's places in one batch and says every one was read: four
    # requests sharing a system prompt once got its bytes in one block of three, garbage in the others.
    client, kv = rank
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(16)))
    h = chained_hashes("shared/system", 4)
    assert client.save(h, [[0, 1, 2, 3]], 4 * U).result(timeout=60).written == 4
    hit = client.lookup(h, 4 * U + 1)
    loads = [LoadItem(f"req-{i}", h, [[8 + 4 * i + b for b in range(4)]], hit) for i in range(4)]
    results = client.load_batch(loads)
    for i in range(4):
        result = results[f"req-{i}"]
        assert not isinstance(result, SidecarError) and result.loaded == 4, result
        for b in range(4):
            assert torch.equal(kv[8 + 4 * i + b].view(torch.uint8), kv[b].view(torch.uint8)), (i, b)
