"""vLLM's KV-cache specs, as the session describes them, built from vLLM's own spec classes; the save checks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch
from vllm.config import ParallelConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvsidecar_client import EngineLayout, GroupSpec, InvalidRequest
from kvsidecar_client.vllm.settings import ConnectorSettings
from kvsidecar_client.vllm.specs import (
    UnsupportedSpec,
    engine_groups,
    group_spec,
    hash_bytes,
    parallel_layout,
)
from kvsidecar_contract.paths import default_target

F32 = torch.float32
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=F32)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=F32, sliding_window=128)
SWA_WIDE = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=F32, sliding_window=4096)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=F32)
SWA_MLA = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=F32, sliding_window=64)
MAMBA = MambaSpec(block_size=64, shapes=((3, 8),), dtypes=(F32,), mamba_cache_mode="align")


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (FULL, GroupSpec("full_attention", 16)),
        (FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=F32, sliding_window=256),
         GroupSpec("full_attention", 32)),  # hybrid allocator off: every block is kept, full-attention rules
        (SWA, GroupSpec("sliding_window", 16, 128)),
        (MLA, GroupSpec("mla", 16)),
        (SWA_MLA, GroupSpec("sliding_window_mla", 16, 64)),
        (MAMBA, GroupSpec("mamba", 64)),
        (UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": FULL, "b": FULL}),
         GroupSpec("full_attention", 16)),
        (UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": MLA, "b": FULL}),
         GroupSpec("uniform", 16, inner=("mla", "full_attention"))),
        (UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": SWA, "b": SWA_WIDE, "c": SWA}),
         GroupSpec("sliding_window", 16, 4096)),  # the widest window
    ],
)  # fmt: skip
def test_group_spec_of_each_vllm_spec(spec, want):
    assert group_spec(spec) == want


def test_a_kind_kvsidecar_cannot_store_is_refused():
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=F32, attention_chunk_size=64)
    with pytest.raises(UnsupportedSpec, match="ChunkedLocalAttentionSpec"):
        group_spec(chunked)


def test_engine_groups_skip_groups_vllm_restores_itself():
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["l0"], FULL),
            KVCacheGroupSpec(["l1"], FULL, enable_kv_transfer=False),  # a replica vLLM rebuilds after a load
            KVCacheGroupSpec(["l2"], MAMBA),
        ],
    )
    groups = engine_groups(config)
    assert groups.specs == (GroupSpec("full_attention", 16), GroupSpec("mamba", 64))
    assert groups.vllm_group_ids == (0, 2)
    assert groups.select(([1, 2], [3], [4])) == [[1, 2], [4]]
    with pytest.raises(InvalidRequest):
        groups.select(([1, 2], [4]))


def test_hash_bytes_follow_vllms_hash_algorithm():
    assert hash_bytes("sha256") == 32
    assert hash_bytes("sha256_cbor") == 32


def test_parallel_layout_from_vllms_parallel_config():
    config = ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2, decode_context_parallel_size=2)
    assert parallel_layout(config, tp_rank=3, pp_rank=1) == EngineLayout(
        tp_size=4, tp_rank=3, pp_size=2, pp_rank=1, pcp_size=1, pcp_rank=0, dcp_size=2
    )


def test_settings_from_extra_config():
    settings = ConnectorSettings.from_extra_config(
        {"socket": "unix:///run/kvsidecar/kvsidecar.sock", "cache_prefix": "prod", "timeouts": {"lookup": 0.5}}
    )
    assert (settings.socket, settings.cache_prefix, settings.deadlines.lookup) == (
        "unix:///run/kvsidecar/kvsidecar.sock",
        "prod",
        0.5,
    )
    assert ConnectorSettings.from_extra_config(None).socket == default_target()
    assert default_target({"XDG_RUNTIME_DIR": "/run/user/7"}) == "unix:///run/user/7/kvsidecar/kvsidecar.sock"
    assert ConnectorSettings.from_extra_config({"share_across_tp": True}).share_across_tp is True
    assert ConnectorSettings.from_extra_config({"share_across_tp": 4}).share_across_tp == 4
    assert not ConnectorSettings.from_extra_config({}).share_across_tp
    for bad in (
        {"sokcet": "x"},
        {"timeouts": {"lookup": 0}},
        {"timeouts": {"soon": 1}},
        {"cache_prefix": 3},
        {"share_across_tp": "yes"},
        {"share_across_tp": 0},
    ):
        with pytest.raises(InvalidRequest):
            ConnectorSettings.from_extra_config(bad)


# The save checks and load reads (vllm/plan.py) are pure: tests/unit/client/test_vllm_plan.py.
