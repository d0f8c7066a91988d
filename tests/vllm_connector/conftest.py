"""Fixtures for tests against the real vLLM: a real kvsidecar daemon (embedded real mooncake_master), a tiny model.

Run under .venv-vllm (scripts/setup-vllm.sh). Without vLLM every module here skips itself, so the main suite,
which collects all of tests/, still passes; this file imports nothing from vLLM for that reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_daemon import cache_prefix, daemon  # noqa: F401 (shared fixtures)

# A llama-shaped config with no weights: vLLM reads it for heads, layers and lengths and never loads a tensor.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
}


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM offline, without usage stats, with its caches in a temp dir (tests are the edge that sets these)."""
    cache = tmp_path_factory.mktemp("vllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("VLLM_NO_USAGE_STATS", "1")
        mp.setenv("VLLM_CACHE_ROOT", str(cache / "vllm"))
        mp.setenv("HF_HOME", str(cache / "hf"))
        mp.setenv("XDG_CACHE_HOME", str(cache / "xdg"))
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with only a config.json (no tokenizer, no weights)."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return path
