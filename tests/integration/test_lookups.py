"""Lookups against a real daemon and a real mooncake_master: a prompt's hashes sent packed into one field or one
field per hash get the same answer, the client packs them only for a daemon that says it reads them, and bad packing
is refused with its reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from kvsidecar_client import EngineLayout, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_client.session import SessionKeeper
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

U = 16


@pytest.fixture
def daemon(mooncake_master, tmp_path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address).start()
    yield d
    assert d.stop() == 0, d.log()


def test_packed_and_listed_hashes_get_the_same_answer_and_bad_packing_its_reason(daemon, key_prefix):
    groups = [group("full_attention", U), group("mamba", U)]
    rank = RawRank(daemon.target, open_request(groups, model="org/Packed", prefix=key_prefix))
    scheduler = RawRank(
        daemon.target, open_request(groups, model="org/Packed", prefix=key_prefix, role=pb.ROLE_SCHEDULER)
    )
    try:
        rank.register()
        hashes = chained_hashes("packed", 6)
        assert rank.save(hashes[:4], [[0, 1, 2, 3]] * 2, 4 * U).failed == 0

        def lookup(**fields: Any) -> pb.LookupResponse:
            request = pb.LookupRequest(session_id=scheduler.session, num_tokens=6 * U + 1, **fields)
            return scheduler.stub.Lookup(request, timeout=30)

        listed = lookup(block_hashes=hashes)
        packed = lookup(packed_block_hashes=b"".join(hashes))
        assert (listed.hit_tokens, list(listed.tail_boundaries)) == (4 * U, [4 * U, 4 * U])
        assert packed == listed
        for fields, reason in (
            ({"packed_block_hashes": b"".join(hashes)[:-1]}, "not a whole number of 32-byte hashes"),
            ({"packed_block_hashes": b"".join(hashes), "block_hashes": hashes}, "both set"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                lookup(**fields)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and reason in refused.value.details()
        assert lookup(block_hashes=hashes) == listed  # the daemon kept serving
    finally:
        rank.close()
        scheduler.close()


def test_the_client_packs_a_lookup_only_for_a_daemon_that_reads_it(daemon, key_prefix, monkeypatch):
    calls: list[tuple[SessionKeeper, pb.LookupRequest]] = []
    real_call = SessionKeeper.call

    def spy(self: SessionKeeper, method: str, request: Any, timeout: float) -> Any:
        if method == "Lookup":
            calls.append((self, pb.LookupRequest.FromString(request.SerializeToString())))
        return real_call(self, method, request, timeout)

    def sent() -> list[pb.LookupRequest]:
        """This client's lookups only: another test's client may still be looking up on a thread of its own."""
        return [request for keeper, request in calls if keeper is client._keeper]

    monkeypatch.setattr(SessionKeeper, "call", spy)
    kv = shared_tensor((8, U, 64), torch.float16)
    client = SidecarClient.connect(
        daemon.target, model="org/PackedClient", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
        groups=[ClientGroup("full_attention", block_size=U)], cache_prefix=key_prefix,
    )  # fmt: skip
    try:
        client.register([kv], groups_of_tensor=[(0,)])
        hashes = chained_hashes("client packs", 4)
        assert client.save(hashes[:3], [[0, 1, 2]], 3 * U).result(timeout=60).failed == 0
        assert client.session_info is not None and client.session_info.packed_hashes
        assert client.lookup(hashes, 4 * U + 1).hit_tokens == 3 * U
        assert sent()[-1].packed_block_hashes == b"".join(hashes) and not sent()[-1].block_hashes
        # A daemon from before packed hashes says nothing of them: the client sends one field per hash.
        keeper = client._keeper
        session = keeper.session
        assert session is not None
        older = dataclasses.replace(session, info=session.info._replace(packed_hashes=False))
        monkeypatch.setattr(keeper, "_session", older)
        assert client.lookup(hashes, 4 * U + 1).hit_tokens == 3 * U
        assert list(sent()[-1].block_hashes) == hashes and not sent()[-1].packed_block_hashes
        # A hash of the wrong length is the engine's bug: named before anything is sent.
        with pytest.raises(Exception, match="block hash 1 has 31 bytes"):
            client.lookup([hashes[0], hashes[1][:-1]], 2 * U + 1)
    finally:
        client.close()
