"""Loads that fail come back to vLLM as recomputation, never as wrong bytes.

The failures are real: values removed from the store after the scheduler's lookup and before the worker's load
(as eviction or a lost node would), or the daemon gone. The real Scheduler then reschedules the tokens.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_daemon import SidecarDaemon
from sidecar_engine import BLOCK, LAYOUTS, Engine, kv_cache_config, vllm_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [(i * 53 + 5) % 1000 for i in range(80)]
HIT = 64  # 80 tokens in blocks of 16: the store serves 64


def engine(model, target, prefix, layout):
    recurrent = "mamba" in layout
    extra = {"socket": target, "cache_prefix": prefix, "timeouts": {"connect": 5, "load": 5}}
    config = vllm_config(model, extra, recurrent=recurrent, chunk=BLOCK if recurrent else 0)
    return Engine.start(config, kv_cache_config(LAYOUTS[layout]))


def save_prompt(model, target, prefix, layout):
    cold = engine(model, target, prefix, layout)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()


def key(warm: Engine, group: int, block_hash: bytes) -> str:
    """The exact key the worker's session saved a block under (docs/placement.md rule 3, TP=PP=PCP=DCP=1)."""
    spec = warm.worker.client.spec
    layout = spec.to_placement()
    assert layout.model_key.startswith("tiny-llama~")
    return f"kvs1@{spec.cache_prefix}@{layout.model_key}@s0.c0.d0.p0.g{group}@{block_hash.hex()}"


def first_compute(warm: Engine, req_id: str):
    """The step that computes the request's first tokens after its load: (tokens computed before, scheduled)."""
    for _ in range(20):
        output = warm.step()
        if req_id in output.num_scheduled_tokens:
            new = [n for n in output.scheduled_new_reqs if n.req_id == req_id]
            start = new[0].num_computed_tokens if new else None
            return start, output.num_scheduled_tokens[req_id]
    raise AssertionError(f"{req_id} was never scheduled")


def test_one_missing_block_is_the_one_block_recomputed(vllm_env, tiny_model, daemon, cache_prefix):
    save_prompt(tiny_model, daemon.target, cache_prefix, "full")
    warm = engine(tiny_model, daemon.target, cache_prefix, "full")
    try:
        warm.add("warm", PROMPT, look_up=True)
        hashes = list(warm.request("warm").block_hashes)

        def lose_block_2(output):
            daemon.remove_keys([key(warm, 0, hashes[2])])  # the value of block 2 (tokens 32..48)

        warm.step(before_worker=lose_block_2)
        request = warm.request("warm")
        # vLLM truncated the hit at the failed block: blocks 0 and 1 loaded, everything from block 2 recomputed.
        assert request.num_computed_tokens == 2 * BLOCK
        start, scheduled = first_compute(warm, "warm")
        assert start == 2 * BLOCK and scheduled == len(PROMPT) - 2 * BLOCK
    finally:
        warm.close()


def test_failed_blocks_are_reported_exactly(vllm_env, tiny_model, daemon, cache_prefix):
    save_prompt(tiny_model, daemon.target, cache_prefix, "full")
    warm = engine(tiny_model, daemon.target, cache_prefix, "full")
    try:
        warm.add("warm", PROMPT, look_up=True)
        hashes = list(warm.request("warm").block_hashes)
        output = warm.scheduler.schedule()
        (load,) = output.kv_connector_metadata.loads
        daemon.remove_keys([key(warm, 0, hashes[1]), key(warm, 0, hashes[3])])
        worker = warm.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)
        deadline = time.monotonic() + 120  # the load's report, however busy the machine
        while not (recving := worker.get_finished(set())[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recving == {"warm"}
        assert worker.get_block_ids_with_load_errors() == {load.block_ids[0][1], load.block_ids[0][3]}
        assert worker.get_block_ids_with_load_errors() == set()  # reported once
        worker.clear_connector_metadata()
    finally:
        warm.close()


@pytest.mark.parametrize("layout", ["full+mamba", "mla+mamba"])
def test_hybrid_failed_load_recomputes_the_request(vllm_env, tiny_model, daemon, cache_prefix, layout):
    # vLLM cannot map block ids back to requests across several groups: the failure is reported by request.
    save_prompt(tiny_model, daemon.target, cache_prefix, layout)
    warm = engine(tiny_model, daemon.target, cache_prefix, layout)
    try:
        warm.add("warm", PROMPT, look_up=True)
        hashes = list(warm.request("warm").block_hashes)
        warm.step(before_worker=lambda _: daemon.remove_keys([key(warm, 0, hashes[2])]))
        # Reported as a failed receive: vLLM drops the whole hit and admits the request again...
        assert warm.request("warm").num_computed_tokens == 0
        # ...where a new lookup finds what is still stored: blocks 0-1 and the recurrent state after them.
        start, scheduled = first_compute(warm, "warm")
        assert (start, scheduled) == (2 * BLOCK, BLOCK)
    finally:
        warm.close()


def test_daemon_gone_before_the_load_recomputes_every_block(vllm_env, tiny_model, tmp_path, cache_prefix):
    own = SidecarDaemon(tmp_path).start()
    try:
        save_prompt(tiny_model, own.target, cache_prefix, "full")
        warm = engine(tiny_model, own.target, cache_prefix, "full")
        try:
            warm.add("warm", PROMPT, look_up=True)
            warm.step(before_worker=lambda _: own.stop())
            assert warm.request("warm").num_computed_tokens == 0
            start, scheduled = first_compute(warm, "warm")
            assert (start, scheduled) == (0, len(PROMPT))
        finally:
            warm.close()
    finally:
        own.stop()
