"""What prefill/decode through the store needs from a producer (docs/vllm.md "Prefill/decode"), with vLLM 0.33's
real Scheduler: a `kv_producer` whose request finishes while its save is still in flight keeps the request's
blocks (vLLM's delayed free: request_finished says so) until the workers report the save done, and only then
frees them, so nothing can overwrite a block the daemon is still reading; once freed, a consumer finds the prompt.
The save is held by the test (HeldSaves), not by timing.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_engine import FULL, Engine, HeldSaves, kv_cache_config, vllm_config

from kvsidecar_client import EngineLayout, SidecarClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = [(i * 41 + 5) % 1000 for i in range(80)]  # five full blocks of 16


def test_a_producer_frees_a_finished_requests_blocks_only_once_its_save_is_done(
    vllm_env, tiny_model, daemon, cache_prefix
):
    config = vllm_config(tiny_model, {"socket": daemon.target, "cache_prefix": cache_prefix}, kv_role="kv_producer")
    engine = Engine.start(config, kv_cache_config((FULL,)))
    held = HeldSaves(engine)
    try:
        engine.add("p", PROMPT, max_tokens=1)
        engine.step(settle=0.5)  # prefill and its one token: the request finishes in this step
        request = engine.request("p")
        assert request.is_finished()
        hashes = list(request.block_hashes)
        blocks = engine.scheduler.kv_cache_manager.get_block_ids("p")[0]
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert len(blocks) == 5
        # Another request decodes meanwhile: vLLM 0.33 returns freed blocks to the pool only after a step that
        # computed something (its deferred frees), so these steps would free p's blocks if nothing held them.
        engine.add("q", [(i * 7 + 3) % 1000 for i in range(20)], max_tokens=30)
        for _ in range(4):  # steps go on; the save is still in flight, so the blocks stay the request's
            engine.step(settle=0.2)
            assert "p" in engine.scheduler.requests
            assert all(pool.blocks[b].ref_cnt > 0 for b in blocks), "a block the daemon still reads was freed"
        held.release()
        held.wait_reported()  # the worker was told: from here its next get_finished reports p sent
        # vLLM frees p when a step's output reports it; a step with no loads returns at once, so wait for that
        # event (bounded), not for a number of steps, which a loaded machine can run before the report is in.
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and (
            "p" in engine.scheduler.requests or any(pool.blocks[b].ref_cnt for b in blocks)
        ):
            engine.step(settle=0.5)
        assert "p" not in engine.scheduler.requests, "the request's blocks were never freed after its save"
        assert all(pool.blocks[b].ref_cnt == 0 for b in blocks), "freed blocks are back in the pool"
        identity = engine.worker.client.spec.value_identity
        groups = engine.worker.client.spec.groups
    finally:
        held.release()
        engine.close()
    with SidecarClient.connect(
        daemon.target, model=str(tiny_model), layout=EngineLayout(), num_kv_heads=2, hash_block_size=16,
        groups=groups, cache_prefix=cache_prefix, value_identity=identity, role="scheduler",
    ) as consumer:  # fmt: skip
        assert consumer.lookup(hashes, len(PROMPT) + 1).hit_tokens == len(PROMPT)
