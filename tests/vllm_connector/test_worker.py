"""The worker role alone: vLLM's factory builds it, it registers shared-memory caches, saves and loads exact bytes."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch
from sidecar_engine import BLOCK, LAYOUTS, allocate, kv_cache_config, layer_parts, vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvsidecar_client import EngineLayout, InvalidRequest, SidecarClient
from kvsidecar_client.vllm import KVSidecarConnector
from kvsidecar_client.vllm.metadata import KVSidecarMetadata, LoadSpec, SaveSpec
from kvsidecar_client.vllm.specs import engine_groups

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HASHES = tuple(bytes([i]) * 32 for i in range(1, 6))  # five chained-hash stand-ins, one per block of 16


def worker(model, daemon, prefix, layout="full"):
    config = vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix})
    kv = kv_cache_config(LAYOUTS[layout])
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv)
    assert isinstance(connector, KVSidecarConnector)
    return connector, kv


def poll(connector, finished: set[str], want: str, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    sent: set[str] = set()
    received: set[str] = set()
    while time.monotonic() < deadline:
        sending, recving = connector.get_finished(finished)
        sent |= sending or set()
        received |= recving or set()
        if want in sent | received:
            return sent, received
        time.sleep(0.01)
    raise AssertionError(f"{want} was never reported finished")


@pytest.mark.parametrize("split_kv", [False, True], ids=["packed-kv", "split-kv"])
def test_save_then_load_into_other_blocks_moves_the_exact_bytes(vllm_env, tiny_model, daemon, cache_prefix, split_kv):
    connector, kv = worker(tiny_model, daemon, cache_prefix)
    caches = allocate(kv, split_kv=split_kv)
    try:
        connector.register_kv_caches(caches)
        generator = torch.Generator().manual_seed(7)
        for cache in caches.values():
            for part in layer_parts(cache):
                part.copy_(torch.randn(part.shape, generator=generator))
        source, target = [10, 11, 12, 13, 14], [40, 41, 42, 43, 44]

        save = SaveSpec("a", HASHES, (tuple(source),), 80, 0, frozenset(source))
        connector.bind_connector_metadata(KVSidecarMetadata(saves=[save], delayed_saves=frozenset({"a"})))
        connector.wait_for_save()
        connector.clear_connector_metadata()
        sent, _ = poll(connector, {"a"}, "a")
        assert sent == {"a"}  # the finished request's blocks may be freed: the daemon has read them

        with SidecarClient.connect(
            daemon.target,
            model=str(tiny_model),
            layout=EngineLayout(),
            num_kv_heads=2,
            hash_block_size=BLOCK,
            groups=engine_groups(kv).specs,
            cache_prefix=cache_prefix,
            value_identity=connector.client.spec.value_identity,  # the worker's: same engine, same values
            role="scheduler",
        ) as scheduler:
            hit = scheduler.lookup(HASHES, 81)
        assert hit.hit_tokens == 80
        load = LoadSpec("b", HASHES, (tuple(target),), hit, 0, (tuple(target),))
        connector.bind_connector_metadata(KVSidecarMetadata(loads=[load], reused_block_ids=frozenset(target)))
        connector.start_load_kv(None)
        connector.clear_connector_metadata()
        _, received = poll(connector, set(), "b")
        assert received == {"b"}
        assert connector.get_block_ids_with_load_errors() == set()
        for cache in caches.values():
            for part in layer_parts(cache):
                assert torch.equal(part[target], part[source])
    finally:
        connector.shutdown()


def test_ordinary_cpu_memory_is_refused_with_how_to_allocate(vllm_env, tiny_model, daemon, cache_prefix):
    connector, kv = worker(tiny_model, daemon, cache_prefix)
    try:
        caches = {name: torch.zeros_like(cache) for name, cache in allocate(kv).items()}
        with pytest.raises(InvalidRequest, match=r"kvsidecar_client.shared_tensor"):
            connector.register_kv_caches(caches)
    finally:
        connector.shutdown()


def test_hybrid_caches_register_in_group_then_layer_order(vllm_env, tiny_model, daemon, cache_prefix):
    connector, kv = worker(tiny_model, daemon, cache_prefix, "full+mamba")
    caches = allocate(kv)
    try:
        connector.register_kv_caches(caches)
        registration = connector.client.registration
        assert registration is not None
        # One value per group = its slices of every region of the group: two attention layers (K|V packed),
        # then two Mamba layers of two state tensors each.
        attention = 2 * BLOCK * 2 * 16 * 4
        mamba = 2 * (3 * 8 + 2 * 4 * 4) * 4
        assert registration.value_bytes == (attention, mamba)
    finally:
        connector.shutdown()
