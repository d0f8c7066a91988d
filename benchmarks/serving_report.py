"""benchmarks/serving.py's report: serving.md's tables (ratios first), the RESULT lines, the TTFT plot; pure, so a
result renders again without vLLM (`serving.py --render`)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["render", "result_lines", "write"]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def render(result: dict[str, Any]) -> str:
    """serving.md's tables: ratios first, then the seconds they come from."""
    lines = []
    model = result["model"]
    lines.append(
        f"Model: random-weight Llama, {model['hidden_size']} hidden, {model['num_hidden_layers']} layers, "
        f"{model['num_attention_heads']} heads / {model['num_key_value_heads']} KV heads, {model['dtype']}; "
        f"vLLM {result['vllm']} on {result['device']}; greedy, {result['max_tokens']} tokens per request, "
        "one request at a time for TTFT. Medians of the prompts of each length."
    )
    lines.append("")
    lines.append(
        "| prompt tokens | warm / cold | warm / vLLM prefix cache | warm / B's own prefix cache | cold (A) s "
        "| vLLM alone cold (C) s | warm from store (B) s | vLLM prefix cache (C) s | prefix cache, connector on (B) s |"
    )
    lines.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, row in result["ttft"].items():
        cold, warm, limit = median(row["cold"]), median(row["warm"]), median(row["prefix_cache"])
        own = median(row["warm_prefix_cache"])
        lines.append(
            f"| {n} | {warm / cold:.3f}x | {warm / limit:.2f}x | {warm / own:.2f}x | {cold:.3f} "
            f"| {median(row['plain_cold']):.3f} | {warm:.3f} | {limit:.3f} | {own:.3f} |"
        )
    lines.append("")
    miss = result["miss"]
    with_c, without = median(miss["connector"]), median(miss["plain"])
    lines.append(
        f"Miss overhead (fresh prompts, never a hit; the connector saves them): {with_c:.0f} tokens/s with the "
        f"connector, {without:.0f} without: **{with_c / without:.3f}x** (rounds: "
        + ", ".join(f"{x:.0f}" for x in miss["connector"])
        + " against "
        + ", ".join(f"{x:.0f}" for x in miss["plain"])
        + ")."
    )
    equal = result["greedy_equal"]
    lines.append(f"Greedy tokens warm equal to cold: {equal['equal']} of {equal['of']} prompts.")
    if "chat" in result:
        lines.append("")
        lines.extend(render_chat(result["chat"]))
        lines.append("")
    daemon = result["daemon"]
    lines.append(
        f"Daemon: {daemon['kvsidecar_saved_bytes_total'] / 2**20:.0f} MiB saved, "
        f"{daemon['kvsidecar_loaded_bytes_total'] / 2**20:.0f} MiB loaded, "
        f"{daemon['warm_hit_tokens']:.0f} tokens hit in the warm pass."
    )
    before, after = result["machine_before"], result["machine_after"]
    lines.append(
        f"Machine: {before['cpu']}, {before['cores']} cores; load average {before['load_average'][0]:.1f} before, "
        f"{after['load_average'][0]:.1f} after; {result['seconds']} s in all."
    )
    return "\n".join(lines) + "\n"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, nearest rank (of a few dozen requests: the p99 is about the slowest)."""
    ordered = sorted(values)
    rank = math.ceil(len(ordered) * q / 100)
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


def chat_figures(run: dict[str, Any]) -> tuple[float, float, float]:
    """(TTFT p50, TTFT p99, generated tokens per second) of one server pass."""
    return median(run["ttft"]), percentile(run["ttft"], 99), run["generated"] / run["wall"]


CHAT_PASSES = {
    "plain": "vLLM alone (prefix cache)",
    "connector": "connector, system prompt not yet stored",
    "connector_restarted": "connector, restarted server (store holds it)",
}


def render_chat(chat: dict[str, Any]) -> list[str]:
    setup = chat["setup"]
    lines = [
        f"OpenAI server (`/v1/completions`, streamed, token-id prompts: the random model has no tokenizer, so no chat "
        f"template): a {setup['system']}-token system prompt shared by every request, then a fresh "
        f"{setup['user']}-token user message; {setup['clients']} clients at once, {setup['requests_each']} requests "
        "each, back to back; a fresh server per pass, vLLM's prefix cache on in each.",
        "",
        "| server | TTFT p50 s | TTFT p99 s | tokens/s (generated) | p50 / vLLM alone | tokens/s / vLLM alone |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = chat_figures(chat["plain"])
    for key, label in CHAT_PASSES.items():
        p50, p99, rate = chat_figures(chat[key])
        lines.append(f"| {label} | {p50:.3f} | {p99:.3f} | {rate:.1f} | {p50 / base[0]:.2f}x | {rate / base[2]:.2f}x |")
    if "kvsidecar_loaded_bytes_total" in chat["connector_restarted"]:
        loaded = [chat[k]["kvsidecar_loaded_bytes_total"] / 2**20 for k in ("connector", "connector_restarted")]
        lines.append("")
        lines.append(
            f"Loaded from the store: {loaded[0]:.0f} MiB by the first connector server, {loaded[1]:.0f} MiB by the "
            "restarted one."
        )
    return lines


def result_lines(result: dict[str, Any]) -> list[str]:
    """The headline ratios as RESULT lines (scripts/gpu-check.sh prints them in its summary)."""
    lines = []
    for n, row in result["ttft"].items():
        cold, warm, limit = median(row["cold"]), median(row["warm"]), median(row["prefix_cache"])
        lines.append(
            f"RESULT serving {n} tokens: TTFT warm/cold {warm / cold:.3f}x, warm/prefix-cache {warm / limit:.2f}x "
            f"(B's own: {warm / median(row['warm_prefix_cache']):.2f}x; {warm:.3f} s, {cold:.3f} s, {limit:.3f} s)"
        )
    miss = result["miss"]
    lines.append(f"RESULT serving miss overhead: {median(miss['connector']) / median(miss['plain']):.3f}x throughput")
    equal = result["greedy_equal"]
    lines.append(f"RESULT serving greedy warm == cold: {equal['equal']}/{equal['of']}")
    if "chat" in result:
        base = chat_figures(result["chat"]["plain"])
        for key in ("connector", "connector_restarted"):
            p50, p99, rate = chat_figures(result["chat"][key])
            lines.append(
                f"RESULT serving OpenAI server {key}: TTFT p50 {p50 / base[0]:.2f}x, tokens/s {rate / base[2]:.2f}x "
                f"of vLLM alone (p50 {p50:.3f} s, p99 {p99:.3f} s, {rate:.1f} tokens/s)"
            )
    return lines


def plot(result: dict[str, Any], path: Path) -> str | None:
    """TTFT by prompt length as a PNG; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    lengths = [int(n) for n in result["ttft"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("cold", "cold prefill (A)"),
        ("warm", "warm from the store (fresh B)"),
        ("prefix_cache", "vLLM's own prefix cache (C)"),
    ):
        ax.plot(lengths, [median(result["ttft"][str(n)][key]) for n in lengths], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT, vLLM {result['vllm']} on {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "serving.md").write_text(render(result))
    why = plot(result, out / "serving.png")
    print(render(result))
    for line in result_lines(result):
        print(line)
    print(f"written to {out}" + (f" (no plot: {why})" if why else ""), file=sys.stderr)
