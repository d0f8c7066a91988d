"""Rule 12 in the connector: a Mamba-like group's state layout read from the model's real config class, checked
against the MambaSpec vLLM's own model code gives a rank of each TP size, and refused where the two disagree.

The specs come from vLLM 0.33's model classes (`get_mamba_state_shape_from_config`, `..._dtype_from_config`) over
the config classes vLLM loads (transformers' GraniteMoeHybrid, FalconH1, NemotronH and Qwen3-Next configs, vLLM's
Kimi-Linear config), in vLLM's default conv layout and in "DS"; what the connector describes must be the same at
every TP size and equal to what the byte oracle (kvsidecar_testing.states) slices as vLLM does.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
import transformers
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from kvsidecar_client import EngineLayout, SessionSpec
from kvsidecar_client.vllm.specs import engine_groups
from kvsidecar_client.vllm.states import StateMismatch, describe_state
from kvsidecar_contract.placement import RecurrentState, gated_delta_net_state, kda_state, mamba2_state

MAMBA2 = MambaAttentionBackendEnum.MAMBA2
GDN = MambaAttentionBackendEnum.GDN_ATTN

# Tiny configs of the real classes: sizes with more than one head, group and k head, so TP really slices them.
GRANITE = dict(
    hidden_size=64, mamba_expand=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
)  # fmt: skip
CONFIGS: dict[str, tuple[Any, str, Any]] = {
    "granite-1-group": (transformers.GraniteMoeHybridConfig(**GRANITE, mamba_n_groups=1), "GraniteMoeHybrid", MAMBA2),
    "granite-2-groups": (transformers.GraniteMoeHybridConfig(**GRANITE, mamba_n_groups=2), "GraniteMoeHybrid", MAMBA2),
    "granite-8-groups": (transformers.GraniteMoeHybridConfig(**GRANITE, mamba_n_groups=8), "GraniteMoeHybrid", MAMBA2),
    "falcon-h1": (
        transformers.FalconH1Config(
            hidden_size=64,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=256,
        ),
        "FalconH1",
        MAMBA2,
    ),
    "nemotron-h": (
        transformers.NemotronHConfig(
            hidden_size=64,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=4,
            ssm_state_size=16,
            conv_kernel=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
        "NemotronH",
        MAMBA2,
    ),
    "qwen3-next": (
        transformers.Qwen3NextConfig(
            hidden_size=64,
            linear_num_value_heads=8,
            linear_num_key_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            vocab_size=256,
        ),
        "Qwen3Next",
        GDN,
    ),
    "kimi-linear": (
        KimiLinearConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=256,
            linear_attn_config={
                "kda_layers": [1],
                "full_attn_layers": [2],
                "num_heads": 8,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        ),
        None,
        GDN,
    ),
}


def vllm_spec(name: str, tp: int, dtype: torch.dtype = torch.bfloat16, num_spec: int = 0) -> MambaSpec:
    """The MambaSpec vLLM's model code gives one layer on a rank of TP tp (block size and cache mode aside)."""
    config, arch, backend = CONFIGS[name]
    cache = SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", use_replayssm=False)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(hf_config=config, hf_text_config=config, dtype=dtype),
        cache_config=cache,
        num_speculative_tokens=num_spec,
        speculative_config=SimpleNamespace(num_speculative_tokens=num_spec) if num_spec else None,
    )
    # Qwen3-Next's and Kimi-Linear's model modules import packages a CPU install lacks (compressed_tensors): their
    # classmethods' calls of vLLM's calculators, argument for argument (qwen3_next.py 882-912; Kimi-Linear's
    # KimiGatedDeltaNetAttention.get_state_shape and get_state_dtype).
    if arch == "Qwen3Next":
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
            config.linear_value_head_dim, config.linear_conv_kernel_dim, num_spec,
        )  # fmt: skip
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtype, "auto", "auto")
    elif arch is None:
        kda = config.linear_attn_config
        shapes = MambaStateShapeCalculator.kda_state_shape(
            tp, kda["num_heads"], kda["head_dim"], conv_kernel_size=kda["short_conv_kernel_size"], num_spec=num_spec
        )
        dtypes = MambaStateDtypeCalculator.kda_state_dtype(dtype, "auto")
    else:
        model = ModelRegistry._try_load_model_cls(f"{arch}ForCausalLM")
        assert model is not None
        shapes = model.get_mamba_state_shape_from_config(vllm_config)
        dtypes = model.get_mamba_state_dtype_from_config(vllm_config)
    return MambaSpec(
        block_size=64, shapes=tuple(shapes), dtypes=tuple(dtypes), mamba_type=backend,
        num_speculative_blocks=num_spec, mamba_cache_mode="align",
    )  # fmt: skip


# The TP sizes vLLM's layers run each at: T divides the heads (and k heads), and the B/C groups or there is one group
# (MambaMixer2's asserts; its shape calculator alone would also size 2 groups over 4 ranks, which the layer refuses).
SUPPORTED = {
    "granite-1-group": (1, 2, 4, 8),
    "granite-2-groups": (1, 2),
    "granite-8-groups": (1, 2, 4, 8),
    "falcon-h1": (1, 2),
    "nemotron-h": (1, 2, 4),
    "qwen3-next": (1, 2, 4),
    "kimi-linear": (1, 2, 4, 8),
}


@pytest.fixture(params=[False, True], ids=["SD", "DS"])
def dim_first(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """vLLM's conv state layout, as VLLM_SSM_CONV_STATE_LAYOUT sets it (its shape calculator asks this function)."""
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: request.param)
    return bool(request.param)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_state_described_from_the_config_is_the_one_vllm_allocates_at_every_tp_size(name, dim_first):
    states = set()
    for tp in SUPPORTED[name]:
        spec = vllm_spec(name, tp)
        state = describe_state(spec, CONFIGS[name][0], tp)
        assert state is not None
        sizes = tuple(torch.Size(s).numel() * d.itemsize for s, d in zip(spec.shapes, spec.dtypes, strict=True))
        assert state.tensor_bytes(tp) == sizes
        states.add(state)
    assert len(states) == 1  # one description, whatever the TP size: what makes its pieces shareable


def test_the_descriptions_are_the_byte_oracles_layers(dim_first):
    from kvsidecar_testing.states import GatedDeltaNet, Kda, Mamba2

    def described(name: str) -> RecurrentState | None:
        return describe_state(vllm_spec(name, 1), CONFIGS[name][0], 1)

    # bf16 conv state; the temporal state bf16 for Mamba2 and gated delta net ("auto": the model's dtype), fp32 for
    # KDA (vLLM's kda_state_dtype).
    assert described("granite-1-group") == Mamba2(8, 16, 1, 16, 4, 2, 2, dim_first).state()
    assert described("granite-2-groups") == Mamba2(8, 16, 2, 16, 4, 2, 2, dim_first).state()
    assert described("qwen3-next") == GatedDeltaNet(4, 8, 16, 32, 4, 2, 2, dim_first).state()
    assert described("kimi-linear") == Kda(8, 16, 4, 2, 4, dim_first).state()


def test_speculative_tokens_widen_the_conv_window_as_vllm_does(dim_first):
    spec = vllm_spec("granite-2-groups", 2, num_spec=2)
    state = describe_state(spec, CONFIGS["granite-2-groups"][0], 2)
    assert state is not None
    conv = state.tensors[0]
    assert (conv.inner if dim_first else conv.outer) == 4 - 1 + 2


def test_a_description_that_disagrees_with_vllms_spec_is_refused_with_the_reason():
    config = CONFIGS["granite-2-groups"][0]
    spec = vllm_spec("granite-2-groups", 2)
    # Another model's sizes (a config that is not the checkpoint's), more tensors (ReplaySSM's ring).
    other = transformers.GraniteMoeHybridConfig(**{**GRANITE, "mamba_d_state": 32}, mamba_n_groups=2)
    with pytest.raises(StateMismatch, match=r"is \[\d+, \d+\] bytes per tensor on a rank of TP 2, but vLLM allocates"):
        describe_state(spec, other, 2)
    ring = replace(spec, shapes=(*spec.shapes, (4, 8, 16)), dtypes=(*spec.dtypes, torch.bfloat16))
    with pytest.raises(StateMismatch, match="but vLLM allocates"):
        describe_state(ring, config, 2, dim_first=False)
    # The conv window where the layout says it is not: SD read of a DS page.
    (window, channels), ssm = spec.shapes
    flipped = replace(spec, shapes=((channels, window), ssm))
    with pytest.raises(StateMismatch, match=r"not a window of 3 first as its conv layout \(SD\) says"):
        describe_state(flipped, config, 2, dim_first=False)
    # A TP size vLLM cannot run the layer at (2 groups over 4 ranks) cannot be described either.
    with pytest.raises(StateMismatch, match="cannot be described for sharing across TP sizes: state axis groups"):
        describe_state(spec, config, 4, dim_first=False)


def test_state_that_is_not_sharded_by_head_or_of_an_unknown_model_is_not_described():
    spec = vllm_spec("granite-2-groups", 1)
    config = CONFIGS["granite-2-groups"][0]
    assert describe_state(replace(spec, tp_replicated=True), config, 1) is None
    assert describe_state(replace(spec, mamba_type=MambaAttentionBackendEnum.MAMBA1), config, 1) is None
    assert describe_state(spec, transformers.JambaConfig(), 1) is None  # Mamba1: per layout
    assert describe_state(vllm_spec("qwen3-next", 1), config, 1) is None  # a GDN spec of a Mamba2 model


def test_engine_groups_describe_recurrent_groups_only_when_asked_and_true_shares_one_piece_per_index():
    config = CONFIGS["granite-1-group"][0]
    mamba = vllm_spec("granite-1-group", 2)
    attention = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    kv = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a.0"], attention), KVCacheGroupSpec(["m.0", "m.1"], mamba)],
    )  # fmt: skip
    assert engine_groups(kv).specs[1].state is None  # without share_across_tp: opaque, per layout
    groups = engine_groups(kv, lambda spec: describe_state(spec, config, 2, dim_first=False))
    state = groups.specs[1].state
    assert state == mamba2_state(
        num_heads=8, head_dim=16, n_groups=1, state_size=16, conv_kernel=4, conv_bytes=2, ssm_bytes=2
    )
    specs = {
        tp: SessionSpec("org/G", EngineLayout(tp_size=tp, tp_rank=tp - 1), 2, 64, groups.specs, share_across_tp=True)
        for tp in (1, 2, 4)
    }
    # N = max(KV heads, every axis) = 8 heads: one piece per head and the one group, at every TP size.
    assert {s.share_tp_size for s in specs.values()} == {8}
    layouts = {tp: s.to_placement() for tp, s in specs.items()}
    assert {layout.group_value_id(1) for layout in layouts.values()} == {layouts[1].group_value_id(1)}
    assert [layouts[tp].values_per_block(1) for tp in (1, 2, 4)] == [9, 5, 3]  # the rank's heads, then the group


def test_kda_and_gated_delta_net_helpers_agree_with_vllms_calculators_for_a_real_models_sizes(dim_first):
    # Qwen3-Next-80B's and Kimi-Linear-48B's published linear-attention sizes, at the TP sizes they are served at.
    for tp in (1, 2, 4, 8):
        gdn = gated_delta_net_state(
            num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4, conv_bytes=2,
            ssm_bytes=2, conv_dim_first=dim_first,
        )  # fmt: skip
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4)
        assert gdn.tensor_bytes(tp) == tuple(torch.Size(s).numel() * 2 for s in shapes)
        kda = kda_state(num_heads=32, head_dim=128, conv_kernel=4, conv_bytes=2, ssm_bytes=4, conv_dim_first=dim_first)
        shapes = MambaStateShapeCalculator.kda_state_shape(tp, 32, 128, conv_kernel_size=4)
        assert kda.tensor_bytes(tp) == (torch.Size(shapes[0]).numel() * 2, torch.Size(shapes[1]).numel() * 4)
