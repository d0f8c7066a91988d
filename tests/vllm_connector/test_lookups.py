"""Lookups with the real Scheduler: one per request, never in the way of the running batch.

A warm engine too small for two requests at once keeps the second one waiting for blocks while the first runs;
vLLM asks the connector for the second one's hit at every one of those steps, and the daemon must see one lookup
for it. After a preemption the request is asked afresh (its earlier answer was spent when it was scheduled).

A lookup the daemon has not answered yet holds up nothing: the connector answers vLLM "not known yet" (None) and
the running requests are scheduled as before, step after step, while the daemon's answer is held back
(`HeldLookups`: a step that returns while the lookup is held did not wait for it); the request then loads its hit
once the answer is in, or computes everything when it comes past the lookup deadline; a request aborted meanwhile
leaves nothing behind.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_engine import FULL, Engine, HeldLookups, kv_cache_config, vllm_config
from vllm.v1.request import RequestStatus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = [(i * 37 + 11) % 1000 for i in range(80)]  # five full blocks of 16
OTHER = [(i * 53 + 5) % 1000 for i in range(80)]
LONG = [(i * 41 + 3) % 1000 for i in range(640)]  # forty full blocks: 624 tokens come from the store


def asked_tokens(daemon) -> float:
    """Prompt tokens the daemon's lookups asked about (each lookup counts its request's tokens)."""
    return daemon.counters().get("kvsidecar_lookup_tokens_total", 0.0)


def small_engine(model, daemon, prefix, num_blocks: int, **extra) -> Engine:
    config = vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix, **extra})
    return Engine.start(config, kv_cache_config((FULL,), num_blocks=num_blocks))


def store(model, daemon, prefix, prompt) -> None:
    """A cold engine computes the prompt and saves it."""
    cold = small_engine(model, daemon, prefix, 96)
    try:
        cold.add("cold", prompt)
        cold.run_until("cold")
    finally:
        cold.close()


def started_at(outputs, req_id: str) -> int:
    """Tokens the request had computed (local cache and store) when the scheduler first computed for it."""
    for output in outputs:
        new = [n for n in output.scheduled_new_reqs if n.req_id == req_id]
        if new:
            return new[0].num_computed_tokens
    raise AssertionError(f"{req_id} was never scheduled")


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


def test_a_lookup_in_flight_does_not_stall_the_running_batch(vllm_env, tiny_model, daemon, cache_prefix):
    store(tiny_model, daemon, cache_prefix, LONG)
    warm = small_engine(tiny_model, daemon, cache_prefix, 96)
    try:
        warm.add("busy", OTHER, max_tokens=40)
        warm.run_until("busy", RequestStatus.RUNNING)
        warm.step()  # its prefill: from here on it decodes one token a step
        held = HeldLookups(warm)
        before = asked_tokens(daemon)
        warm.add("long", LONG)
        computed = warm.request("busy").num_computed_tokens
        for step in range(8):
            output = warm.step(answer_lookups=False)
            if step == 0:
                held.wait_started(1)
            # The long prompt's lookup is held at the daemon's door, so this step did not wait for its answer...
            assert warm.connector.lookups_in_flight == 1
            # ...and the running request was scheduled as if the long one were not there.
            assert output.num_scheduled_tokens.get("busy") == 1
            assert "long" not in output.num_scheduled_tokens
            assert warm.request("long").status == RequestStatus.WAITING
        assert warm.request("busy").num_computed_tokens == computed + 8
        assert held.started == 1

        held.release()
        outputs = warm.run_until("long", RequestStatus.RUNNING)
        assert started_at(outputs, "long") == 624, "the answer that came late must still be the one loaded"
        assert asked_tokens(daemon) - before == len(LONG), "one lookup for the request however many steps it waited"
        assert warm.connector.lookups_in_flight == 0
        warm.run_until("busy")
    finally:
        warm.close()


def test_a_lookup_past_its_deadline_is_a_miss(vllm_env, tiny_model, daemon, cache_prefix):
    store(tiny_model, daemon, cache_prefix, LONG)
    warm = small_engine(tiny_model, daemon, cache_prefix, 96, timeouts={"lookup": 0.5})
    try:
        held = HeldLookups(warm)
        warm.add("long", LONG)
        outputs = []
        give_up = time.monotonic() + 60
        # Until the scheduler first computes for it (it may finish in that step: then it is never seen running).
        while not any("long" in o.num_scheduled_tokens for o in outputs) and time.monotonic() < give_up:
            outputs.append(warm.step(answer_lookups=False))
            time.sleep(0.02)  # an idle engine's steps, a little apart
        # The daemon never answered in time: the request computes its whole prompt rather than wait longer.
        held.wait_started(1)
        assert started_at(outputs, "long") == 0
        assert warm.connector.lookups_in_flight == 0
        held.release()  # the late answer reaches nobody
        warm.run_until("long")
    finally:
        warm.close()


def test_a_request_aborted_during_its_lookup_leaves_nothing_behind(vllm_env, tiny_model, daemon, cache_prefix):
    store(tiny_model, daemon, cache_prefix, LONG)
    warm = small_engine(tiny_model, daemon, cache_prefix, 96)
    try:
        held = HeldLookups(warm)
        warm.add("long", LONG)
        output = warm.step(answer_lookups=False)
        held.wait_started(1)
        assert "long" not in output.num_scheduled_tokens and warm.connector.lookups_in_flight == 1
        warm.scheduler.finish_requests("long", RequestStatus.FINISHED_ABORTED)
        assert warm.connector.lookups_in_flight == 0
        held.release()
        # Its id used again is a new request: it gets its own lookup, and the hit.
        warm.add("long", LONG)
        outputs = warm.run_until("long", RequestStatus.RUNNING)
        assert started_at(outputs, "long") == 624
        warm.run_until("long")
        assert warm.connector.lookups_in_flight == 0
    finally:
        warm.close()
