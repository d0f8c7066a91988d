"""A namespace's values have one shape on a daemon: a registration laid out otherwise under it is refused."""

from __future__ import annotations

import grpc
import pytest

from kvsidecar.store.memory_store import MemoryStore
from support.inprocess import InProcessDaemon
from support.rawrank import RawRank, group, open_request


@pytest.fixture
def daemon(tmp_path):
    d = InProcessDaemon(tmp_path, MemoryStore(), allow_shm_names=True).start()
    yield d
    d.stop()


def test_another_shape_under_a_live_namespace_is_refused_with_the_reason(daemon):
    request = open_request([group("full_attention", 16)], model="org/Same")
    first = RawRank(daemon.target, request, block_bytes=1024)
    other = RawRank(daemon.target, request, block_bytes=2048)
    same = RawRank(daemon.target, request, block_bytes=1024)
    try:
        first.register()
        with pytest.raises(grpc.RpcError) as refused:
            other.register()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "pieces of [1024] bytes, this registration's are [2048]" in refused.value.details()
        same.register()  # the same shape under the same namespace: replicas and identical engines share it
    finally:
        for r in (first, other, same):
            r.close()


def test_a_namespace_no_live_session_fills_takes_any_shape_again(daemon):
    request = open_request([group("full_attention", 16)], model="org/Again")
    first = RawRank(daemon.target, request, block_bytes=1024)
    first.register()
    first.close()
    later = RawRank(daemon.target, request, block_bytes=2048)
    try:
        later.register()
    finally:
        later.close()


def test_other_identities_never_constrain_each_other(daemon):
    a = open_request([group("full_attention", 16)], model="org/Two")
    b = open_request([group("full_attention", 16)], model="org/Two")
    b.engine.value_identity = "another-layout"
    ranks = [RawRank(daemon.target, a, block_bytes=1024), RawRank(daemon.target, b, block_bytes=2048)]
    try:
        for r in ranks:
            r.register()
    finally:
        for r in ranks:
            r.close()
