"""benchmarks/serving.py's OpenAI-server workload: vLLM's OpenAI server (with the connector or without) and clients
at once, each sending a shared system prompt and a fresh user message, streamed; and what an engine and a server are
told to reach the bench's daemon (kv_transfer)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving_setup import Preset, Progress, Prompts

__all__ = ["Served", "chat_passes", "kv_transfer"]


def kv_transfer(socket: str, prefix: str) -> dict[str, Any]:
    """The README's --kv-transfer-config, pointed at the bench's daemon and namespace."""
    return {
        "kv_connector": "KVSidecarConnector",
        "kv_connector_module_path": "kvsidecar_client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": socket, "cache_prefix": prefix},
    }


@dataclass
class Served:
    """One request served alone: time to its first token, to its last, and its greedy tokens."""

    ttft: float
    total: float
    tokens: list[int]


def start_server(model_dir: Path, preset: Preset, log: Path, *, socket: str | None, prefix: str) -> Any:
    """vLLM's OpenAI server over the model (tests/vllm_real/openai_server.py), with the connector when `socket` is
    given, sized as the preset's engines."""
    from openai_server import OpenAIServer

    flags = [
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", preset.dtype, "--seed", "0", "--disable-log-stats",
        "--max-model-len", str(preset.max_model_len), "--max-num-batched-tokens", str(max(4096, preset.miss_length)),
        "--enable-prefix-caching",
    ]  # fmt: skip
    if socket is not None:
        flags += ["--kv-transfer-config", json.dumps(kv_transfer(socket, prefix))]
    if "gpu_memory_utilization" in preset.llm:
        flags += ["--gpu-memory-utilization", str(preset.llm["gpu_memory_utilization"])]
    return OpenAIServer(model_dir, flags, log, start_timeout=600)


def stream_one(server: Any, prompt: Sequence[int], max_tokens: int) -> Served:
    """One streamed greedy completion through the server: time to its first token and to its last."""
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    for ids in server.stream(prompt, max_tokens):
        if ids and first is None:
            first = time.perf_counter() - started
        tokens.extend(ids)
    total = time.perf_counter() - started
    if first is None or len(tokens) != max_tokens:
        raise RuntimeError(f"a streamed completion ended with {len(tokens)} of {max_tokens} tokens")
    return Served(first, total, tokens)


def chat_pass(server: Any, system: Sequence[int], users: list[list[list[int]]], max_tokens: int) -> dict[str, Any]:
    """Every client (one list of user messages each) sends system + message, one after the other, all clients at
    once: each request's TTFT, and tokens per second over the pass."""
    barrier = threading.Barrier(len(users))
    served: list[list[Served]] = [[] for _ in users]

    def client(i: int) -> None:
        barrier.wait()
        for message in users[i]:
            served[i].append(stream_one(server, [*system, *message], max_tokens))

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        for future in [pool.submit(client, i) for i in range(len(users))]:
            future.result()
    wall = time.perf_counter() - started
    generated = sum(len(s.tokens) for per in served for s in per)
    prompt_tokens = sum(len(system) + len(m) for per in users for m in per)
    return {
        "ttft": [s.ttft for per in served for s in per],
        "wall": wall,
        "generated": generated,
        "prompt_tokens": prompt_tokens,
        "tokens": [s.tokens for per in served for s in per],
    }


def chat_passes(
    model_dir: Path, preset: Preset, work: Path, daemon: Any, prompts: Prompts, step: Progress, settle: float
) -> dict[str, Any]:
    """The shared-system-prompt workload on three fresh servers, vLLM's prefix cache on in each: with the connector
    (the system prompt not yet stored), without it, and with it again after a restart (the store holds it)."""
    system_tokens, user_tokens, clients, each = preset.chat
    system = prompts.fresh(system_tokens)
    prefix = f"chat{uuid.uuid4().hex[:8]}"
    passes: dict[str, Any] = {}
    for label, connector in (("connector", True), ("plain", False), ("connector_restarted", True)):
        step(f"OpenAI server ({label}): {clients} clients x {each} requests, {system_tokens}+{user_tokens} tokens")
        users = [[prompts.fresh(user_tokens) for _ in range(each)] for _ in range(clients)]
        socket = daemon.target if connector else None
        server = start_server(model_dir, preset, work / f"server-{label}.log", socket=socket, prefix=prefix)
        try:
            stream_one(server, prompts.fresh(256), 4)  # first-request costs out of the measurements
            time.sleep(settle)
            before = daemon.counters()
            passes[label] = chat_pass(server, system, users, preset.max_tokens)
            after = daemon.counters()
        finally:
            server.stop()
        del passes[label]["tokens"]
        for name in ("kvsidecar_lookup_hit_tokens_total", "kvsidecar_loaded_bytes_total"):
            passes[label][name] = after.get(name, 0.0) - before.get(name, 0.0)
    passes["setup"] = {"system": system_tokens, "user": user_tokens, "clients": clients, "requests_each": each}
    return passes
