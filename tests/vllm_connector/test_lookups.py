"""One store lookup per request, not per step: the real Scheduler re-asks for a waiting request at every step.

A warm engine too small for two requests at once keeps the second one waiting for blocks while the first runs;
vLLM asks the connector for the second one's hit at every one of those steps, and the daemon must see one lookup
for it. After a preemption the request is asked afresh (its earlier answer was spent when it was scheduled).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_engine import FULL, Engine, kv_cache_config, vllm_config
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [(i * 37 + 11) % 1000 for i in range(80)]  # five full blocks of 16
OTHER = [(i * 53 + 5) % 1000 for i in range(80)]


def asked_tokens(daemon) -> float:
    """Prompt tokens the daemon's lookups asked about (each lookup counts its request's tokens)."""
    return daemon.counters().get("kvsidecar_lookup_tokens_total", 0.0)


def small_engine(model, daemon, prefix, num_blocks: int) -> Engine:
    config = vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix})
    return Engine.start(config, kv_cache_config((FULL,), num_blocks=num_blocks))


class CountingAsks:
    """Counts vLLM's get_num_new_matched_tokens calls per request (the real connector still answers them)."""

    def __init__(self, engine: Engine) -> None:
        self.asks: dict[str, int] = {}
        connector = engine.connector
        ask = connector.get_num_new_matched_tokens

        def counted(request, num_computed_tokens):
            self.asks[request.request_id] = self.asks.get(request.request_id, 0) + 1
            return ask(request, num_computed_tokens)

        connector.get_num_new_matched_tokens = counted  # type: ignore[method-assign]


def test_a_waiting_request_is_looked_up_once(vllm_env, tiny_model, daemon, cache_prefix):
    cold = small_engine(tiny_model, daemon, cache_prefix, 96)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()

    # 9 blocks (one is vLLM's null block): "first" holds 6 of them while it runs, "second" needs 6 and waits.
    warm = small_engine(tiny_model, daemon, cache_prefix, 9)
    asks = CountingAsks(warm)
    try:
        warm.add("first", OTHER, max_tokens=8)
        warm.step()
        before = asked_tokens(daemon)
        warm.add("second", PROMPT)
        warm.run_until("first")
        assert asks.asks["second"] >= 3, f"the scheduler asked only {asks.asks} times: the test proves nothing"
        waiting_lookups = (asked_tokens(daemon) - before) / len(PROMPT)
        assert waiting_lookups == 1, f"{asks.asks['second']} asks made {waiting_lookups} lookups"
        # The answer kept while it waited is the one the load serves: 64 of 80 tokens from the store.
        outputs = warm.run_until("second", RequestStatus.RUNNING)
        scheduled = [o for o in outputs if "second" in o.num_scheduled_tokens]
        new = [n for n in scheduled[0].scheduled_new_reqs if n.req_id == "second"]
        assert new and new[0].num_computed_tokens == 64
        assert asked_tokens(daemon) - before == len(PROMPT)
    finally:
        warm.close()


def test_a_preempted_request_is_looked_up_again(vllm_env, tiny_model, daemon, cache_prefix):
    cold = small_engine(tiny_model, daemon, cache_prefix, 96)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()

    warm = small_engine(tiny_model, daemon, cache_prefix, 96)
    asks = CountingAsks(warm)
    try:
        before = asked_tokens(daemon)
        warm.add("warm", PROMPT, max_tokens=20)
        warm.run_until("warm", RequestStatus.RUNNING)
        assert asked_tokens(daemon) - before == len(PROMPT)
        request = warm.request("warm")
        # vLLM's public way to preempt every running request (the same path as running out of blocks).
        assert warm.scheduler.reset_prefix_cache(reset_running_requests=True)
        assert request.status == RequestStatus.PREEMPTED
        resumed_tokens = request.num_tokens  # the prompt and the tokens generated before the preemption
        warm.run_until("warm", RequestStatus.RUNNING)
        assert asks.asks["warm"] >= 2
        asked = asked_tokens(daemon) - before
        assert asked == len(PROMPT) + resumed_tokens, "a preempted request must ask the store afresh, once"
    finally:
        warm.close()
