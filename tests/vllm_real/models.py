"""Tiny random-weight models built from transformers configs (no download), with the vLLM settings each needs.

initializer_range=0.2: with the default 0.02 random models degenerate into repeated tokens, and equal cold and
warm outputs would prove little. Per-architecture caveats of vLLM CPU are in shared/design/VLLM.md.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 1024


@dataclass(frozen=True)
class TinyModel:
    """A model to build and the LLM settings it runs with on vLLM CPU."""

    name: str
    config_class: str
    config: dict[str, Any]
    dtype: str
    prompt_tokens: tuple[int, ...]  # one prompt per length
    llm: dict[str, Any] = field(default_factory=dict)
    recurrent: bool = False
    max_position_embeddings: int = 4096

    def build(self, root: Path) -> Path:
        """Save the model with random weights under root/name (seeded: every build is the same model)."""
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        path = root / self.name
        if (path / "config.json").exists():
            return path
        config = getattr(transformers, self.config_class)(
            vocab_size=VOCAB,
            initializer_range=0.2,
            max_position_embeddings=self.max_position_embeddings,
            **self.config,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, self.dtype))
        model.save_pretrained(path)
        return path


LLAMA = TinyModel(
    name="llama-gqa",
    config_class="LlamaConfig",
    config={
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
    },
    dtype="float32",
    prompt_tokens=(300, 333, 420, 517),
)

# Mamba2 + attention. The CPU Mamba2 scan ignores return_intermediate_states, so with prefix caching on a step
# must not pass a block boundary it does not end on: max_num_batched_tokens=128. fp32: bf16 has exact logit ties.
GRANITE_HYBRID = TinyModel(
    name="granitemoehybrid",
    config_class="GraniteMoeHybridConfig",
    config={
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
        "mamba_chunk_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 256,
        "position_embedding_type": "rope",
    },
    dtype="float32",
    prompt_tokens=(300, 333, 420, 517),
    llm={"max_num_batched_tokens": 128},
    recurrent=True,
)

# Gated delta net + attention + MoE (the closest to seed 000's Kimi-Linear). vLLM CPU's GDN kernel needs bf16 and
# linear-attention head dims of 128; its hybrid block is 640 tokens here, so prompts are longer than that. A
# recurrent state can be stored only where a step ends on a block boundary: steps of 128 tokens end on every one.
QWEN3_NEXT = TinyModel(
    name="qwen3-next",
    config_class="Qwen3NextConfig",
    config={
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    dtype="bfloat16",
    prompt_tokens=(800, 900, 1000),
    llm={"max_model_len": 2048, "max_num_batched_tokens": 128},
    recurrent=True,
)

# The same with two k heads and two v heads, so that TP=2 can shard its gated delta net (vLLM needs T to divide both).
QWEN3_NEXT_K2 = dataclasses.replace(
    QWEN3_NEXT,
    name="qwen3-next-k2",
    config={**QWEN3_NEXT.config, "linear_num_key_heads": 2, "linear_num_value_heads": 2},
)

MODELS = {m.name: m for m in (LLAMA, GRANITE_HYBRID, QWEN3_NEXT, QWEN3_NEXT_K2)}


def prompts(model: TinyModel) -> list[list[int]]:
    """Seeded random token-id prompts of the model's lengths (a periodic prompt lets a model copy it instead)."""
    rng = random.Random(f"{model.name}-prompts")
    return [[rng.randrange(1, VOCAB - 24) for _ in range(n)] for n in model.prompt_tokens]
