"""The serving bench's setup (benchmarks/serving.py): its presets (a random-weight Llama and the workload sized for a
kind of machine), the model built from one, its prompts that never share a first block, and its progress lines."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "Preset", "Progress", "Prompts", "tiny_model"]


@dataclass(frozen=True)
class Preset:
    """A model and the workload sized for one kind of machine."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    dtype: str
    lengths: tuple[int, ...]  # prompt lengths of the TTFT passes
    prompts_per_length: int
    miss_batch: int  # prompts per miss-overhead batch
    miss_length: int
    miss_rounds: int
    max_tokens: int  # greedy tokens per request (compared cold against warm)
    chat: tuple[int, int, int, int]  # the OpenAI-server workload: system prompt, user message, clients, requests each
    segment: str = "2GiB"  # the daemon's store: every prompt of the run stays in it (no eviction)
    llm: dict[str, Any] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return max(*self.lengths, self.miss_length) + self.max_tokens


PRESETS = {
    # 2 CPU cores: a 4k-token prefill takes a few seconds; the whole run a few minutes.
    "cpu": Preset(
        hidden=1024,
        layers=8,
        heads=16,
        kv_heads=8,
        intermediate=2048,
        dtype="float32",
        lengths=(1000, 2000, 4000),
        prompts_per_length=2,
        miss_batch=4,
        miss_length=1000,
        miss_rounds=5,
        max_tokens=16,
        chat=(2000, 200, 4, 3),
    ),
    # A check that the bench runs end to end (seconds per engine), not a measurement.
    "smoke": Preset(
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=256,
        dtype="float32",
        lengths=(200, 400),
        prompts_per_length=1,
        miss_batch=2,
        miss_length=200,
        miss_rounds=1,
        max_tokens=8,
        chat=(200, 40, 2, 1),
        segment="256MiB",
    ),
    # One GPU: a bigger model and longer prompts, each engine in a quarter of the GPU's memory.
    "gpu": Preset(
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=8,
        intermediate=5632,
        dtype="bfloat16",
        lengths=(2000, 8000, 16000, 32000),
        prompts_per_length=3,
        miss_batch=16,
        miss_length=2000,
        miss_rounds=5,
        max_tokens=16,
        chat=(8000, 400, 16, 4),
        segment="32GiB",
        llm={"gpu_memory_utilization": 0.25},
    ),
}


def tiny_model(preset: Preset, name: str) -> Any:
    """The preset's Llama-like config as a tests/vllm_real TinyModel (random weights, seeded)."""
    from models import TinyModel

    config = {
        "hidden_size": preset.hidden,
        "intermediate_size": preset.intermediate,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "num_hidden_layers": preset.layers,
    }
    return TinyModel(
        name=name,
        config_class="LlamaConfig",
        config=config,
        dtype=preset.dtype,
        prompt_tokens=preset.lengths,
        max_position_embeddings=max(4096, preset.max_model_len),
    )


class Prompts:
    """Seeded random token-id prompts that share no first block with each other (so nothing hits by accident)."""

    def __init__(self, vocab: int, seed: str) -> None:
        self._rng = random.Random(seed)
        self._vocab = vocab

    def fresh(self, length: int) -> list[int]:
        return [self._rng.randrange(1, self._vocab - 24) for _ in range(length)]


class Progress:
    """Timestamped progress lines on stderr."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {what}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self._start
