"""A cold request saves through the real Scheduler and worker hooks; the same prompt in another engine hits.

Engines here are real vLLM Schedulers with the connector on both sides, a real daemon and a real mooncake_master;
only the forward pass is a stand-in (sidecar_engine.write_kv). The warm engine is a second engine with its own
memory, as after a restart or on another replica of the node: its hit can only come from the store.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_engine import BLOCK, LAYOUTS, Engine, HeldLookups, kv_cache_config, vllm_config
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [(i * 37 + 11) % 1000 for i in range(80)]  # five full blocks of 16


def engine(model, daemon, prefix, layout: str, **kw):
    specs = LAYOUTS[layout]
    recurrent = "mamba" in layout
    # A recurrent group holds only the state after the tokens computed so far: the prefill must stop at every
    # block end for the store to get each block's state (the connector never stores a state it does not hold).
    chunk = kw.pop("chunk", BLOCK if recurrent else 0)
    config = vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix}, recurrent=recurrent, chunk=chunk)
    return Engine.start(config, kv_cache_config(specs), **kw)


def external_tokens(warm: Engine, req_id: str, prompt, **kw) -> int:
    """Tokens the real Scheduler takes from the store for a new request (0: it computes from the start)."""
    warm.add(req_id, prompt, **kw)
    for _ in range(20):
        output = warm.step()
        if req_id in output.num_scheduled_tokens:
            new = [n for n in output.scheduled_new_reqs if n.req_id == req_id]
            return new[0].num_computed_tokens if new else -1
    raise AssertionError(f"{req_id} was never scheduled")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cold_saves_then_another_engine_hits_the_same_prompt(vllm_env, tiny_model, daemon, cache_prefix, layout):
    saved_before = daemon.counters().get("kvsidecar_saved_bytes_total", 0.0)
    cold = engine(tiny_model, daemon, cache_prefix, layout)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()
    assert daemon.counters()["kvsidecar_saved_bytes_total"] > saved_before

    warm = engine(tiny_model, daemon, cache_prefix, layout)
    try:
        warm.add("warm", PROMPT)
        first = warm.step()
        # The hit is loaded asynchronously: the request waits for the workers, no token is computed for it yet.
        assert warm.request("warm").status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
        assert "warm" not in first.num_scheduled_tokens
        outputs = warm.run_until("warm", RequestStatus.RUNNING)
        scheduled = [o for o in outputs if "warm" in o.num_scheduled_tokens]
        # 80 prompt tokens, blocks of 16: the store serves 64 (the last block holds the last token, recomputed).
        request = warm.request("warm")
        assert request.num_computed_tokens >= 64
        first_compute = scheduled[0]
        new = [n for n in first_compute.scheduled_new_reqs if n.req_id == "warm"]
        start = new[0].num_computed_tokens if new else None
        assert start == 64, f"expected 64 external tokens, the scheduler started at {start}"
        table = warm.scheduler.kv_cache_manager.get_block_ids("warm")
        for gid, group in enumerate(warm.kv.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                indices = [64 // BLOCK - 1]  # the state after the hit, in the block that holds its last token
            elif isinstance(spec, SlidingWindowSpec):
                indices = range((64 - spec.sliding_window) // BLOCK, 64 // BLOCK)  # the window before the hit
            else:
                indices = range(64 // BLOCK)
            for index in indices:
                got = warm.block_bytes(gid, table[gid][index])
                want = warm.expected_block(PROMPT, gid, index, 64)
                for got_layer, want_layer in zip(got, want, strict=True):
                    for g, w in zip(got_layer, want_layer, strict=True):
                        assert (g == w).all(), f"group {gid} block {index}: wrong bytes loaded"
    finally:
        warm.close()


def test_tenants_never_share_a_block(vllm_env, tiny_model, daemon, cache_prefix):
    cold = engine(tiny_model, daemon, cache_prefix, "full")
    try:
        cold.add("cold", PROMPT, cache_salt="tenant-a")
        cold.run_until("cold")
    finally:
        cold.close()
    warm = engine(tiny_model, daemon, cache_prefix, "full")
    try:
        # vLLM folds cache_salt into the first block hash, so every chained hash (and key) differs per salt.
        assert external_tokens(warm, "other-salt", PROMPT, cache_salt="tenant-b") == 0
        assert external_tokens(warm, "no-salt", PROMPT) == 0
        assert external_tokens(warm, "same-salt", PROMPT, cache_salt="tenant-a") == 64
    finally:
        warm.close()
    other = engine(tiny_model, daemon, cache_prefix + "x", "full")
    try:
        # Another cache_prefix is another namespace in the store.
        assert external_tokens(other, "other-prefix", PROMPT, cache_salt="tenant-a") == 0
    finally:
        other.close()


def test_a_recurrent_state_the_engine_did_not_keep_is_never_stored(vllm_env, tiny_model, daemon, cache_prefix):
    # The prefill runs in steps of 64 and 16 tokens: vLLM keeps the Mamba state after 64 and after 80 tokens only,
    # never the states after 16, 32 or 48. Those spans go to the daemon as NO_BLOCK; the rest is stored.
    cold = engine(tiny_model, daemon, cache_prefix, "full+mamba", chunk=0)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()
    warm = engine(tiny_model, daemon, cache_prefix, "full+mamba")
    try:
        # The state after 64 tokens was held and stored, with every attention block before it: a 64-token hit.
        assert external_tokens(warm, "warm", PROMPT) == 64
        # No state after 16, 32 or 48 tokens was stored, so a 49-token prefix gets nothing (rather than a state
        # that was never computed).
        assert external_tokens(warm, "short", PROMPT[:49]) == 0
    finally:
        warm.close()


def test_requests_of_one_step_share_one_save_call_and_one_load_call(vllm_env, tiny_model, daemon, cache_prefix):
    # Three prompts scheduled in the same steps: each step's saves go to the daemon as one SaveBatch, the warm
    # engine's three loads as one LoadBatch, and every request still gets exactly its own hit.
    prompts = {f"p{i}": [(t * 37 + 11 + 101 * i) % 1000 for t in range(80)] for i in range(3)}
    before = daemon.requests_by_method()
    cold = engine(tiny_model, daemon, cache_prefix, "full")
    try:
        for name, prompt in prompts.items():
            cold.add(name, prompt, look_up=True)
        outputs = [cold.step()]
        # The whole prefill of all three in one step, so that step saves all three.
        assert {s.req_id for s in outputs[0].kv_connector_metadata.saves} == set(prompts)
        for name in prompts:
            outputs += cold.run_until(name)
    finally:
        cold.close()  # waits for the saves in flight
    after_cold = daemon.requests_by_method()
    steps_saving = sum(1 for output in outputs if output.kv_connector_metadata.saves)
    assert after_cold.get("SaveBatch", 0) - before.get("SaveBatch", 0) == steps_saving
    assert after_cold.get("Save", 0) == before.get("Save", 0)

    warm = engine(tiny_model, daemon, cache_prefix, "full")
    try:
        held = HeldLookups(warm)
        for name, prompt in prompts.items():
            warm.add(name, prompt)
        asked = warm.step(answer_lookups=False)  # the three lookups start; none is answered yet
        held.wait_started(3)
        assert not asked.kv_connector_metadata.loads
        held.release()
        assert warm.connector.wait_for_lookups(30)
        planned = warm.step()  # every lookup hits, every load is planned in this step
        assert {load.req_id for load in planned.kv_connector_metadata.loads} == set(prompts)
        starts: dict[str, int] = {}
        for _ in range(20):
            output = warm.step()
            starts.update({n.req_id: n.num_computed_tokens for n in output.scheduled_new_reqs})
            if set(starts) == set(prompts):
                break
        assert starts == dict.fromkeys(prompts, 64)
        # Scheduled only once reported received: the loads are done, all three in one call.
        loaded = daemon.requests_by_method()
        assert loaded.get("LoadBatch", 0) - after_cold.get("LoadBatch", 0) == 1
        assert loaded.get("Load", 0) == after_cold.get("Load", 0)
        for name, prompt in prompts.items():
            table = warm.scheduler.kv_cache_manager.get_block_ids(name)
            for index in range(64 // BLOCK):
                got = warm.block_bytes(0, table[0][index])
                want = warm.expected_block(prompt, 0, index, 64)
                for got_layer, want_layer in zip(got, want, strict=True):
                    for g, w in zip(got_layer, want_layer, strict=True):
                        assert (g == w).all(), f"{name} block {index}: wrong bytes loaded"
    finally:
        warm.close()


def test_a_requests_retention_comes_from_its_kv_transfer_params_or_the_engines_default(
    vllm_env, tiny_model, daemon, cache_prefix
):
    from kvsidecar_client import Retention

    extra = {"socket": daemon.target, "cache_prefix": cache_prefix, "retention": {"seconds": 60}}
    asked = {"retention_directives": [{"start": 0, "end": 32, "priority": 80, "duration": 600}]}
    cold = Engine.start(vllm_config(tiny_model, extra), kv_cache_config(LAYOUTS["full"]))
    try:
        cold.add("asked", PROMPT, kv_transfer_params=asked, look_up=True)
        cold.add("default", [(t + 500) % 1000 for t in PROMPT], look_up=True)
        cold.add("wrong", [(t + 700) % 1000 for t in PROMPT], kv_transfer_params={"retention_seconds": "soon"})
        saves = {s.req_id: s.retention for o in cold.run_until("wrong") for s in o.kv_connector_metadata.saves}
    finally:
        cold.close()  # waits for the saves in flight
    assert saves == {
        "asked": Retention(600, 80, end_tokens=32),
        "default": Retention(60),
        "wrong": Retention(60),  # a request that gets them wrong keeps the default (and the log says why)
    }
    # The daemon keeps them: 2 boundaries of "asked", 5 of each of the others, within the single tenant's budget.
    (usage,) = json.loads(daemon.status().stdout)["retention"]
    assert usage["values"] >= 12, usage
