"""Two daemons over one real master: the same value identity hits across them byte for byte; another misses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvsidecar_client import EngineLayout, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_testing.processes import DaemonProcess

pytestmark = pytest.mark.integration

HASHES = [bytes([7, i]) * 16 for i in range(1, 4)]  # three blocks of 16 tokens


@pytest.fixture
def two_daemons(mooncake_master, tmp_path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    a = DaemonProcess(tmp_path / "a", master=mooncake_master.address)
    b = DaemonProcess(tmp_path / "b", master=mooncake_master.address)
    for daemon in (a, b):
        daemon.workdir.mkdir()
        daemon.start()
    try:
        yield a, b
    finally:
        for daemon in (a, b):
            assert daemon.stop() == 0, daemon.log()


@contextlib.contextmanager
def rank(daemon: DaemonProcess, identity: str, prefix: str) -> Iterator[tuple[SidecarClient, torch.Tensor]]:
    kv = shared_tensor((8, 16, 64), torch.float16)
    client = SidecarClient.connect(
        daemon.target, model="org/Same-Name", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
        groups=[ClientGroup("full_attention", block_size=16)], cache_prefix=prefix, value_identity=identity,
    )  # fmt: skip
    try:
        client.register([kv], groups_of_tensor=[(0,)])
        yield client, kv
    finally:
        client.close()


def test_the_same_identity_is_shared_across_daemons_and_another_never(two_daemons, key_prefix):
    a, b = two_daemons
    with rank(a, "weights-1", key_prefix) as (writer, kv):
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(5)))
        assert writer.save(HASHES, [[0, 1, 2]], 48).result(timeout=30).written == 3
        with rank(b, "weights-1", key_prefix) as (reader, other):
            hit = reader.lookup(HASHES, 49)
            assert hit.hit_tokens == 48
            assert reader.load(HASHES, [[5, 6, 7]], hit) == set()
            assert torch.equal(other[5:8].view(torch.uint8), kv[0:3].view(torch.uint8))
        with rank(b, "weights-2", key_prefix) as (stranger, _):
            assert stranger.lookup(HASHES, 49).hit_tokens == 0
