"""The worker role alone: vLLM's factory builds it, it registers shared-memory caches, saves and loads exact bytes."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch
from sidecar_engine import (
    BLOCK,
    LAYOUTS,
    NUM_BLOCKS,
    HeldSaves,
    allocate,
    kv_cache_config,
    layer_parts,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvsidecar_client import DaemonUnavailable, EngineLayout, InvalidRequest, SidecarClient
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


def poll_all(connector, finished: set[str], want: set[str], timeout: float = 30.0) -> tuple[set[str], set[str]]:
    """Everything reported finished until every request of `want` was (reports come once each)."""
    deadline = time.monotonic() + timeout
    sent: set[str] = set()
    received: set[str] = set()
    while time.monotonic() < deadline:
        sending, recving = connector.get_finished(finished)
        sent |= sending or set()
        received |= recving or set()
        if want <= sent | received:
            return sent, received
        time.sleep(0.01)
    raise AssertionError(f"{sorted(want - sent - received)} were never reported finished")


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


def test_a_step_of_many_requests_is_one_save_and_one_load_call_answered_per_request(
    vllm_env, tiny_model, daemon, cache_prefix
):
    connector, kv = worker(tiny_model, daemon, cache_prefix)
    caches = allocate(kv)
    try:
        connector.register_kv_caches(caches)
        generator = torch.Generator().manual_seed(14)
        for cache in caches.values():
            for part in layer_parts(cache):
                part.copy_(torch.randn(part.shape, generator=generator))
        # Four requests of 1-4 blocks, each its own prompt, saved in one step.
        prompts = {f"r{n}": tuple(bytes([n, i]) * 16 for i in range(1, n + 1)) for n in range(1, 5)}
        sources = {"r1": [0], "r2": [1, 2], "r3": [3, 4, 5], "r4": [6, 7, 8, 9]}
        before = daemon.requests_by_method()
        saves = [
            SaveSpec(r, prompts[r], (tuple(sources[r]),), len(prompts[r]) * BLOCK, 0, frozenset(sources[r]))
            for r in prompts
        ]
        connector.bind_connector_metadata(KVSidecarMetadata(saves=saves, delayed_saves=frozenset(prompts)))
        connector.wait_for_save()
        connector.clear_connector_metadata()
        sent, _ = poll_all(connector, set(prompts), set(prompts))
        assert sent == set(prompts)  # every request learns its own saves are done
        middle = daemon.requests_by_method()
        assert middle.get("SaveBatch", 0) - before.get("SaveBatch", 0) == 1
        assert middle.get("Save", 0) == before.get("Save", 0)

        with SidecarClient.connect(
            daemon.target, model=str(tiny_model), layout=EngineLayout(), num_kv_heads=2, hash_block_size=BLOCK,
            groups=engine_groups(kv).specs, cache_prefix=cache_prefix,
            value_identity=connector.client.spec.value_identity, role="scheduler",
        ) as scheduler:  # fmt: skip
            hits = {r: scheduler.lookup(prompts[r], len(prompts[r]) * BLOCK + 1) for r in prompts}
        assert {r: h.hit_tokens for r, h in hits.items()} == {r: len(prompts[r]) * BLOCK for r in prompts}
        targets = {"r1": [20], "r2": [21, 22], "r3": [23, 24, 25], "r4": [26, 27, 28, 29]}
        loads = [LoadSpec(r, prompts[r], (tuple(targets[r]),), hits[r], 0, (tuple(targets[r]),)) for r in prompts]
        # Three more in the same step: one whose values were never stored (every block fails, by name), one the
        # daemon refuses (a block id past the cache: recompute all it asked), one the scheduler already refused.
        never = tuple(bytes([9, i]) * 16 for i in range(1, 3))
        loads.append(LoadSpec("miss", never, ((30, 31),), hits["r2"], 0, ((30, 31),)))
        loads.append(LoadSpec("bad", prompts["r1"], ((NUM_BLOCKS + 7,),), hits["r1"], 0, ((32,),)))
        loads.append(LoadSpec("refused", prompts["r1"], ((33,),), hits["r1"], 0, ((33,),), refused="skew"))
        reused = frozenset(b for spec in loads for group in spec.reads for b in group)
        connector.bind_connector_metadata(KVSidecarMetadata(loads=loads, reused_block_ids=reused))
        connector.start_load_kv(None)
        connector.clear_connector_metadata()
        _, received = poll_all(connector, set(), {spec.req_id for spec in loads})
        assert received == {spec.req_id for spec in loads}
        # Single-group cache: vLLM learns exactly which blocks to recompute, and of which requests.
        assert connector.get_block_ids_with_load_errors() == {30, 31, 32, 33}
        after = daemon.requests_by_method()
        assert after.get("LoadBatch", 0) - middle.get("LoadBatch", 0) == 1
        assert after.get("Load", 0) == middle.get("Load", 0)
        for cache in caches.values():
            for part in layer_parts(cache):
                for r in prompts:
                    assert torch.equal(part[targets[r]], part[sources[r]]), r
    finally:
        connector.shutdown()


# When the save's outcome reaches the worker, against the step whose metadata says the request finished
# (delayed_saves), and what the outcome is: the daemon's answer, a failed save, or a client that crashed.
WHEN = ("while-running", "same-step", "after")
OUTCOMES: dict[str, BaseException | None] = {
    "ok": None,
    "failed": DaemonUnavailable("the daemon went away", method="SaveBatch"),
    "raised": RuntimeError("a client bug"),
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
@pytest.mark.parametrize("when", WHEN)
def test_every_save_of_a_finished_request_is_reported_done_exactly_once(
    vllm_env, tiny_model, daemon, cache_prefix, when, outcome
):
    """vLLM frees a delayed request's blocks only once get_finished reports it: a report lost for any outcome (a
    save that failed, a client that crashed) would hold them for ever, a leak of the engine's KV cache."""
    connector, kv = worker(tiny_model, daemon, cache_prefix)
    caches = allocate(kv)
    try:
        connector.register_kv_caches(caches)
        held = HeldSaves(connector)

        def step(meta: KVSidecarMetadata, finished: set[str], before_report: Any = None) -> set[str]:
            connector.bind_connector_metadata(meta)
            connector.wait_for_save()
            if before_report is not None:
                before_report()
            sending, _ = connector.get_finished(finished)
            connector.clear_connector_metadata()
            return sending or set()

        def release() -> None:
            held.release(OUTCOMES[outcome])
            held.wait_reported()

        save = SaveSpec("a", HASHES, ((10, 11, 12, 13, 14),), 80, 0, frozenset(range(10, 15)))
        reported = step(KVSidecarMetadata(saves=[save]), set())
        assert reported == set(), "a save still held was reported done"
        if when == "while-running":
            release()
            reported |= step(KVSidecarMetadata(delayed_saves=frozenset({"a"})), {"a"})
        elif when == "same-step":
            reported |= step(KVSidecarMetadata(delayed_saves=frozenset({"a"})), {"a"}, release)
        else:
            reported |= step(KVSidecarMetadata(delayed_saves=frozenset({"a"})), {"a"})
            assert reported == set(), "a save still held was reported done"
            release()
            reported |= step(KVSidecarMetadata(), set())
        assert reported == {"a"}, f"the {outcome} save, done {when}, was never reported: its blocks would leak"
        for _ in range(3):
            assert step(KVSidecarMetadata(), set()) == set(), "a request was reported done twice"
    finally:
        connector.shutdown()
