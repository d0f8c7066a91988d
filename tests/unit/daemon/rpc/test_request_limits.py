"""A Lookup larger than --max-lookup-hashes allows is refused by its size, before it is parsed, over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from kvsidecar.rpc import wire
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar_contract.limits import MAX_HASH_BYTES
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc
from support.inprocess import InProcessDaemon
from support.rawrank import group, open_request

LIMIT = 16


def test_the_size_limit_never_refuses_a_lookup_the_hash_limit_allows():
    widest = pb.LookupRequest(
        session_id="s" * 64, block_hashes=[bytes([i]) * MAX_HASH_BYTES for i in range(LIMIT)], num_tokens=1 << 40
    )
    assert widest.ByteSize() <= wire.lookup_request_bytes(LIMIT)
    assert wire.lookup_request_bytes(1 << 17) < 10 << 20  # the default's bound: under 10 MiB, not --max-message-bytes


@pytest.fixture
def daemon(tmp_path):
    d = InProcessDaemon(tmp_path, MemoryStore(), max_lookup_hashes=LIMIT).start()
    yield d
    d.stop()


def test_an_oversized_lookup_is_refused_by_its_size_naming_the_limit_and_others_go_on(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.SidecarStub(channel)
        request = open_request([group("full_attention", 16)], role=pb.ROLE_SCHEDULER)
        request.hash_bytes = MAX_HASH_BYTES  # the widest hashes, so the largest requests the hash limit allows
        opened = stub.OpenSession(request, timeout=30)
        sid = opened.session_id
        huge = pb.LookupRequest(session_id=sid, block_hashes=[i.to_bytes(MAX_HASH_BYTES, "big") for i in range(2048)])
        huge.num_tokens = 2048 * 16 + 1
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(huge, timeout=30)
        most = wire.lookup_request_bytes(LIMIT)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            f"a LookupRequest of {huge.ByteSize()} bytes: at most {most} per call "
            f"(--max-lookup-hashes {LIMIT} hashes of at most {MAX_HASH_BYTES} bytes)"
        )
        # Under the size bound but past the count: the per-call limit refuses it, naming it too.
        past = pb.LookupRequest(session_id=sid, block_hashes=[bytes([i]) * MAX_HASH_BYTES for i in range(LIMIT + 1)])
        past.num_tokens = (LIMIT + 1) * 16 + 1
        with pytest.raises(grpc.RpcError) as counted:
            stub.Lookup(past, timeout=30)
        assert counted.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"a Lookup of {LIMIT + 1} block hashes: at most {LIMIT} per call" in counted.value.details()
        # The widest lookup the limit allows is answered (a miss: nothing stored).
        widest = pb.LookupRequest(session_id=sid, block_hashes=[bytes([i]) * MAX_HASH_BYTES for i in range(LIMIT)])
        widest.num_tokens = LIMIT * 16 + 1
        assert stub.Lookup(widest, timeout=30).hit_tokens == 0
    assert daemon.sample("kvsidecar_requests_rejected_total", {"method": "Lookup", "code": "INVALID_ARGUMENT"}) == 2
