"""Values carry what they mean (docs/values.md): engines whose bytes mean something else never hit each other.

Each pair is two real vLLM schedulers and workers on one real daemon, same prompt, same cache prefix, same model
directory name, differing in exactly one property; the first saves, the second looks up. Identical deployments
(two engines, so two sessions, over one daemon and master) do hit, and so do deployments an operator pins to one
model identity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch
from conftest import TINY_MODEL
from sidecar_engine import BLOCK, FULL, Engine, kv_cache_config, vllm_config
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvsidecar_client.vllm import identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = [(i * 29 + 3) % 1000 for i in range(80)]
HIT = 64


def model_dir(root: Path, *, weights: bytes = b"base" * 1000, **config: object) -> Path:
    """A `tiny-llama` checkpoint directory: the shared config (with overrides) and one weight file."""
    path = root / "tiny-llama"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**TINY_MODEL, **config}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def start(model: Path, daemon, prefix: str, *, spec=FULL, layout: str | None = None, **extra: object) -> Engine:
    config = vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix, **extra})
    kv = kv_cache_config((spec,))
    kv.kv_cache_layout = layout
    return Engine.start(config, kv)


def matched(engine: Engine) -> int:
    """Tokens the engine's scheduler connector finds stored for PROMPT."""
    engine.add("probe", PROMPT)
    request = engine.request("probe")
    found, _ = engine.connector.get_num_new_matched_tokens(request, 0)
    if found is None:  # not answered yet: vLLM would ask again at its next step
        assert engine.connector.wait_for_lookups(60), "the probe's lookup was never answered"
        found, _ = engine.connector.get_num_new_matched_tokens(request, 0)
    assert found is not None
    return int(found)


def save(engine: Engine) -> None:
    try:
        engine.add("cold", PROMPT)
        engine.run_until("cold")
    finally:
        engine.close()


def reader_hits(writer: Engine, reader_factory) -> int:
    save(writer)
    reader = reader_factory()
    try:
        return matched(reader)
    finally:
        reader.close()


def test_identical_deployments_share_values(vllm_env, tmp_path, daemon, cache_prefix):
    a, b = model_dir(tmp_path / "node-a"), model_dir(tmp_path / "node-b")  # same checkpoint, other paths
    assert reader_hits(start(a, daemon, cache_prefix), lambda: start(b, daemon, cache_prefix)) == HIT


F16 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
BF16 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
# (writer's, reader's) model files and engine settings; each pair differs in exactly one property.
SAME: dict = {"model": {}, "engine": {"layout": "LBNHC"}}
DIFFER: dict[str, tuple[dict, dict]] = {
    "weights": ({**SAME, "model": {"weights": b"base" * 1000}}, {**SAME, "model": {"weights": b"tune" * 1000}}),
    "config": (SAME, {**SAME, "model": {"rope_theta": 50000.0}}),
    "model-dtype": (SAME, {**SAME, "model": {"torch_dtype": "bfloat16"}}),
    "kv-dtype": (  # the same bytes per block, read as other numbers
        {**SAME, "engine": {"layout": "LBNHC", "spec": F16}},
        {**SAME, "engine": {"layout": "LBNHC", "spec": BF16}},
    ),
    "kv-layout": (SAME, {**SAME, "engine": {"layout": "LHBNC"}}),
    "region-order": (SAME, {**SAME, "region_order": 1}),
}


@pytest.mark.parametrize("differ", list(DIFFER))
def test_deployments_differing_in_one_property_never_share_a_value(
    vllm_env, tmp_path, daemon, cache_prefix, differ, monkeypatch
):
    ours, theirs = DIFFER[differ]
    writer = start(model_dir(tmp_path / "w", **ours["model"]), daemon, cache_prefix, **ours["engine"])
    reader_model = model_dir(tmp_path / "r", **theirs["model"])

    def reader() -> Engine:
        monkeypatch.setattr(identity, "REGION_ORDER", identity.REGION_ORDER + theirs.get("region_order", 0))
        return start(reader_model, daemon, cache_prefix, **theirs["engine"])

    assert reader_hits(writer, reader) == 0


def test_a_pinned_model_identity_shares_values_across_checkpoints_that_sample_differently(
    vllm_env, tmp_path, daemon, cache_prefix
):
    a = model_dir(tmp_path / "a", weights=b"shard-layout-1" * 100)
    b = model_dir(tmp_path / "b", weights=b"shard-layout-2" * 100)
    assert reader_hits(start(a, daemon, cache_prefix), lambda: start(b, daemon, cache_prefix)) == 0
    pin = {"model_identity": "llama-3-8b@sha256:0123"}
    prefix = cache_prefix + "-pinned"
    assert reader_hits(start(a, daemon, prefix, **pin), lambda: start(b, daemon, prefix, **pin)) == HIT


def test_the_weights_sample_tells_a_fine_tune_from_its_base(tmp_path):
    base = model_dir(tmp_path / "base", weights=bytes(300_000))
    tuned = bytearray(300_000)
    tuned[150_000] = 1  # one number in the middle of the file
    fine = model_dir(tmp_path / "fine", weights=bytes(tuned))
    assert identity.weights_sample(str(base)) != identity.weights_sample(str(fine))
    assert identity.weights_sample(str(base)) == identity.weights_sample(
        str(model_dir(tmp_path / "copy", weights=bytes(300_000)))
    )
    assert identity.weights_sample(str(tmp_path / "no-such-dir")) is None


def test_the_identity_does_not_follow_the_tp_size(tmp_path):
    """A rank's share of the KV heads is vLLM's per-rank spec field; the identity leaves it out (the daemon's value id
    keeps T wherever bytes depend on it), so engines of other TP sizes can share values (placement rule 11)."""
    import dataclasses

    model = model_dir(tmp_path)
    config = vllm_config(model, {"socket": "unix:///nowhere"})
    heads = FULL.num_kv_heads
    at = {
        n: identity.value_identity(config, kv_cache_config((dataclasses.replace(FULL, num_kv_heads=n),)))
        for n in (heads, heads * 2)
    }
    assert at[heads] == at[heads * 2]
    other = kv_cache_config((dataclasses.replace(FULL, head_size=FULL.head_size * 2),))
    assert identity.value_identity(config, other) != at[heads]
