"""Is a store hit worth it on this GPU? A 4096-token prefix's prefill against loading its KV through the daemon.

For a Llama-3-8B shape and a 32B shape (random weights, bf16, sdpa attention; only the last token's logits), one
process measures the prefill of a 4096-token prompt with transformers, then the same prompt's KV cache (vLLM 0.33's
layout: one buffer, every layer a view of it; 16-token blocks) saved to and loaded back from a real daemon over
CUDA IPC, and the GPU's own limit for that load (one DMA up, one scatter kernel). Loaded bytes are compared on the
GPU. Prints RESULT lines and writes --out (JSON). Needs only torch and transformers besides kvsidecar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TOKENS = 4096
BLOCK = 16
SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
    "32b": (5120, 64, 40, 8, 27648, 152064),
}


def median_ms(fn: Any, runs: int = 3) -> float:
    """Median wall time of fn() in ms over `runs` runs after one warm-up, each synchronized."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefill_ms(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda:0"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    prompt = torch.randint(0, vocab, (1, TOKENS), device="cuda:0")

    def forward() -> None:
        model(prompt, use_cache=False, logits_to_keep=1)

    with torch.inference_mode():
        ms = median_ms(forward)
    model.to("meta")  # its 16-64 GB of weights go back before the next shape
    torch.cuda.empty_cache()
    return ms


def load_ms(target: str, layers: int, kv_heads: int) -> dict[str, float]:
    """Save the prompt's blocks through the daemon, then time loading them into other blocks (and the GPU's limit)."""
    from kvsidecar_client import EngineLayout, GroupSpec, Hit, SidecarClient
    from kvsidecar_testing.hashes import chained_hashes

    blocks = TOKENS // BLOCK
    slice_bytes = BLOCK * kv_heads * 2 * 128 * 2  # K and V, head dim 128, bf16
    whole = torch.empty(layers * 2 * blocks * slice_bytes, dtype=torch.uint8, device="cuda:0")
    per_layer = whole.view(layers, 2 * blocks, slice_bytes)
    words = per_layer.view(torch.int64)
    torch.arange(words.numel(), out=words.view(-1), dtype=torch.int64)
    torch.cuda.synchronize()
    client = SidecarClient.connect(
        target,
        model=f"serving/{layers}x{kv_heads}",
        layout=EngineLayout(),
        num_kv_heads=kv_heads,
        hash_block_size=BLOCK,
        groups=[GroupSpec("full_attention", BLOCK)],
        client_name="serving-limit",
    )
    try:
        client.register(list(per_layer.unbind(0)), [(0,)] * layers)
        hashes = chained_hashes(f"serving/{layers}/{time.time_ns()}", blocks)
        t0 = time.perf_counter()
        saved = client.save(hashes, [list(range(blocks))], TOKENS + 1).result()
        save = (time.perf_counter() - t0) * 1e3
        if saved.written != blocks:
            raise SystemExit(f"save wrote {saved.written} of {blocks} blocks: {saved}")
        hit = client.lookup(hashes, TOKENS + 1)
        if hit.hit_tokens != TOKENS:
            raise SystemExit(f"lookup hit {hit.hit_tokens} of {TOKENS} tokens")
        targets = [list(range(blocks, 2 * blocks))]

        def load() -> None:
            out = client.load_detailed(hashes, targets, Hit(TOKENS, (TOKENS,)))
            if out.loaded != blocks or out.failures:
                raise SystemExit(f"load read {out.loaded} of {blocks} blocks: {out.failures[:3]}")

        through = median_ms(load, runs=5)
        if not torch.equal(per_layer[:, :blocks], per_layer[:, blocks:]):
            raise SystemExit("loaded blocks differ from the saved ones")
        # The limit: the same bytes up from pinned memory in one DMA, scattered by one kernel.
        view = torch.as_strided(
            whole.view(torch.int64),
            (2 * blocks, layers, slice_bytes // 8),
            (slice_bytes // 8, 2 * blocks * slice_bytes // 8, 1),
        )
        host = torch.empty(blocks * layers * slice_bytes, dtype=torch.uint8, pin_memory=True)
        staging = torch.empty_like(host, device="cuda:0")
        index = torch.arange(blocks, 2 * blocks, device="cuda:0")

        def limit() -> None:
            staging.copy_(host, non_blocking=True)
            view.index_copy_(0, index, staging.view(torch.int64).view(blocks, layers, slice_bytes // 8))

        return {
            "save_ms": save,
            "load_ms": through,
            "limit_ms": median_ms(limit, runs=5),
            "mib": blocks * layers * slice_bytes / 2**20,
        }
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    from kvsidecar_testing.processes import DaemonProcess

    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "tokens": TOKENS, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="serving-limit-") as work:
        daemon = DaemonProcess(Path(work), segment_size="8GiB", log_level="info")
        daemon.start(timeout=120)
        try:
            deadline = time.monotonic() + 120
            while not daemon.metric_samples("kvsidecar_gpu_pinned_segment_bytes").get("", 0.0):
                if time.monotonic() > deadline:
                    raise SystemExit("the daemon did not page-lock its segment in 120 s")
                time.sleep(0.2)
            for name in args.shapes.split(","):
                hidden, layers, heads, kv_heads, inter, vocab = SHAPES[name]
                row = load_ms(daemon.target, layers, kv_heads)
                try:
                    row["prefill_ms"] = prefill_ms(hidden, layers, heads, kv_heads, inter, vocab)
                except Exception as exc:  # the load is the product's; a transformers mishap must not hide it
                    row["prefill_error"] = f"{type(exc).__name__}: {exc}"
                results["shapes"][name] = row
                prefill = row.get("prefill_ms")
                speedup = f", {prefill / row['load_ms']:.1f}x faster than its recompute" if prefill else ""
                print(
                    f"RESULT {name} {TOKENS}-token prefix ({row['mib']:.0f} MiB): load through the daemon "
                    f"{row['load_ms']:.1f} ms (limit {row['limit_ms']:.1f} ms, {row['limit_ms'] / row['load_ms']:.2f}x "
                    f"of it), save {row['save_ms']:.1f} ms, prefill "
                    + (f"{prefill:.0f} ms" if prefill else row.get("prefill_error", "?"))
                    + speedup,
                    flush=True,
                )
        finally:
            daemon.stop()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
