"""The recurrent state layout of a vLLM Mamba-like KV-cache group (docs/placement.md rule 12), from the model's config,
checked against the group's MambaSpec before the daemon is told.

A group's state is described only where the model is one whose layers vLLM 0.33 shards as rule 12 says (Mamba2:
GraniteMoeHybrid, FalconH1, NemotronH; gated delta net: Qwen3-Next; KDA: Kimi-Linear; read from the config fields
their vLLM models read) and the description gives exactly the
bytes of every state tensor vLLM allocates on this rank (`MambaSpec.shapes` and `dtypes`): a description that
disagrees is refused with the reason, never sent, since another TP size would misread what it stores. A model that
is none of these, or whose state vLLM does not shard by head (`tp_replicated`, another backend), is not described:
its state stays per layout, readable by its own TP size only.

Pure but for vLLM's imports: config objects in, a RecurrentState (or None) out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_contract.placement import (
    PlacementError,
    RecurrentState,
    gated_delta_net_state,
    kda_state,
    mamba2_state,
)

__all__ = ["StateMismatch", "conv_dim_first", "describe_state"]


class StateMismatch(InvalidRequest):
    """The state the model's config describes is not what vLLM allocates on this rank: sharing it is refused."""


def conv_dim_first() -> bool:
    """Whether vLLM lays conv states out (channels, window) ("DS", VLLM_SSM_CONV_STATE_LAYOUT) instead of
    (window, channels): vLLM's own answer, the one its layers and its shape calculator use."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return bool(is_conv_state_dim_first())


def _item(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


def _mamba2(config: Any, spec: MambaSpec, dim_first: bool) -> RecurrentState:
    """GraniteMoeHybrid and FalconH1 (`mamba_*` fields), NemotronH (its own names): as their vLLM models read them."""
    if config.model_type == "nemotron_h":
        heads, head_dim = int(config.mamba_num_heads), int(config.mamba_head_dim)
        groups, state_size, kernel = int(config.n_groups), int(config.ssm_state_size), int(config.conv_kernel)
        inter = heads * head_dim
    else:
        heads, head_dim = int(config.mamba_n_heads), int(config.mamba_d_head)
        groups, state_size, kernel = int(config.mamba_n_groups), int(config.mamba_d_state), int(config.mamba_d_conv)
        inter = int(getattr(config, "mamba_d_ssm", None) or config.mamba_expand * config.hidden_size)
    return mamba2_state(
        num_heads=heads, head_dim=head_dim, n_groups=groups, state_size=state_size, conv_kernel=kernel,
        conv_bytes=_item(spec.dtypes[0]), ssm_bytes=_item(spec.dtypes[1]), intermediate_size=inter,
        num_spec=spec.num_speculative_blocks, conv_dim_first=dim_first,
    )  # fmt: skip


def _gated_delta_net(config: Any, spec: MambaSpec, dim_first: bool) -> RecurrentState:
    """Qwen3-Next (`linear_*` fields, as `Qwen3NextForCausalLM.get_mamba_state_shape_from_config` reads them)."""
    return gated_delta_net_state(
        num_k_heads=int(config.linear_num_key_heads), num_v_heads=int(config.linear_num_value_heads),
        head_k_dim=int(config.linear_key_head_dim), head_v_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim), conv_bytes=_item(spec.dtypes[0]),
        ssm_bytes=_item(spec.dtypes[1]), num_spec=spec.num_speculative_blocks, conv_dim_first=dim_first,
    )  # fmt: skip


def _kda(config: Any, spec: MambaSpec, dim_first: bool) -> RecurrentState:
    """Kimi-Linear (`linear_attn_config`, as `KimiGatedDeltaNetAttention` reads it)."""
    kda = config.linear_attn_config
    return kda_state(
        num_heads=int(kda["num_heads"]), head_dim=int(kda["head_dim"]),
        conv_kernel=int(kda["short_conv_kernel_size"]), conv_bytes=_item(spec.dtypes[0]),
        ssm_bytes=_item(spec.dtypes[1]), num_spec=spec.num_speculative_blocks, conv_dim_first=dim_first,
    )  # fmt: skip


# By the model's config type, and the backend vLLM runs its recurrent layers with: only models whose layers are
# known to shard their state as rule 12 says (docs/placement.md, with the vLLM source it rests on).
_READERS: dict[tuple[str, Any], Callable[[Any, MambaSpec, bool], RecurrentState]] = {
    ("granitemoehybrid", MambaAttentionBackendEnum.MAMBA2): _mamba2,
    ("falcon_h1", MambaAttentionBackendEnum.MAMBA2): _mamba2,
    ("nemotron_h", MambaAttentionBackendEnum.MAMBA2): _mamba2,
    ("qwen3_next", MambaAttentionBackendEnum.GDN_ATTN): _gated_delta_net,
    ("kimi_linear", MambaAttentionBackendEnum.GDN_ATTN): _kda,
}


def describe_state(
    spec: MambaSpec, hf_config: Any, tp_size: int, *, dim_first: bool | None = None
) -> RecurrentState | None:
    """The state layout of one layer of a MambaSpec group, or None where the model's state is not one rule 12 cuts.

    hf_config is the model's text config (vLLM's `model_config.hf_text_config`); its `model_type` picks the reader.
    Raises StateMismatch when the
    description's tensors are not the spec's on a rank of tp_size: their number, each one's bytes, and the conv
    window's place (first dim in vLLM's default layout, last with "DS").
    """
    reader = _READERS.get((getattr(hf_config, "model_type", ""), spec.mamba_type))
    if reader is None or spec.tp_replicated:
        return None
    dim_first = conv_dim_first() if dim_first is None else dim_first
    where = f"{type(hf_config).__name__}'s {spec.mamba_type.name} state"
    try:
        state = reader(hf_config, spec, dim_first)
        described = state.tensor_bytes(tp_size)
    except (PlacementError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise StateMismatch(f"{where} cannot be described for sharing across TP sizes: {error}") from None
    allocated = tuple(math.prod(shape) * _item(dtype) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=False))
    if len(spec.shapes) != len(spec.dtypes) or described != allocated:
        raise StateMismatch(
            f"{where} as its config describes it ({state.describe()}) is {list(described)} bytes per tensor on a "
            f"rank of TP {tp_size}, but vLLM allocates {list(allocated)} (shapes {list(spec.shapes)}): it cannot be "
            "stored for other TP sizes (turn share_across_tp off, or report the model)"
        )
    window = spec.shapes[0][-1 if dim_first else 0]
    expected = state.tensors[0].inner if dim_first else state.tensors[0].outer
    if len(spec.shapes[0]) != 2 or window != expected:
        raise StateMismatch(
            f"{where}: vLLM's conv state has shape {spec.shapes[0]}, not a window of {expected} "
            f"{'last' if dim_first else 'first'} as its conv layout ({'DS' if dim_first else 'SD'}) says"
        )
    return state
