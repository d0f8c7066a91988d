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

from kvsidecar_client import NO_BLOCK, EngineLayout, GroupSpec, InvalidRequest
from kvsidecar_client.results import GroupPlacement, SessionInfo
from kvsidecar_client.vllm.plan import check_save, load_block_ids, saved_chunks, shape_of
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
    for bad in ({"sokcet": "x"}, {"timeouts": {"lookup": 0}}, {"timeouts": {"soon": 1}}, {"cache_prefix": 3}):
        with pytest.raises(InvalidRequest):
            ConnectorSettings.from_extra_config(bad)


# ---- which blocks a save reads, and when it must not be sent ----

ATTN_MAMBA = shape_of(
    (GroupSpec("full_attention", 16), GroupSpec("mamba", 16)),
    SessionInfo(10_000, 16, False, (GroupPlacement(1, 0, 1, 16), GroupPlacement(1, 0, 1, 16)), "x"),
    16,
)
NULL = 0


def test_a_save_stores_each_new_block_under_its_end():
    assert saved_chunks(ATTN_MAMBA, 48, 16) == [[(1, 32), (2, 48)], [(1, 32), (2, 48)]]


def test_a_recurrent_group_is_saved_only_for_the_state_it_holds():
    # One block per step: the recurrent state in memory is the state after exactly num_tokens tokens.
    ok = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, 5, 6]], 48, 32, NULL)
    assert ok.ok and ok.reads == {3, 6} and ok.chunks == 2
    assert ok.block_ids == ((1, 2, 3), (NULL, 5, 6))
    # A whole prompt in one step: the states after 16 and 32 tokens were never kept. Those spans go as NO_BLOCK
    # (the daemon skips them); the attention blocks and the state after 48 are stored.
    whole = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, NULL, 6]], 48, 0, NULL)
    assert whole.ok and whole.reads == {1, 2, 3, 6} and whole.chunks == 4
    assert whole.block_ids == ((1, 2, 3), (NO_BLOCK, NO_BLOCK, 6))
    assert "state after 16" in whole.reason
    # Nothing right to store: not sent at all.
    none = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, NULL, NULL]], 48, 32, NULL)
    assert (none.ok, none.chunks) == (True, 1)  # the attention block 3 still is
    mamba_only = shape_of(
        (GroupSpec("mamba", 16),), SessionInfo(10_000, 16, False, (GroupPlacement(1, 0, 1, 16),), "x"), 16
    )
    assert not check_save(mamba_only, [[NULL, NULL, NULL]], 48, 0, NULL).ok


def test_a_null_block_is_never_read():
    swa = shape_of(
        (GroupSpec("sliding_window", 16, 32),),
        SessionInfo(10_000, 16, False, (GroupPlacement(1, 0, 1, 16),), "x"),
        16,
    )
    retired = check_save(swa, [[NULL, 2, 3]], 48, 0, NULL)  # the window retired block 0
    assert retired.reads == {2, 3} and retired.block_ids == ((NO_BLOCK, 2, 3),)
    assert check_save(swa, [[NULL, 2, 3]], 48, 16, NULL).reads == {2, 3}


def test_a_load_writes_the_hit_blocks_past_the_local_prefix():
    ids = [[1, 2, 3, 4], [9, 9, 7, 8]]
    assert load_block_ids(ATTN_MAMBA, ids, 64, 16) == [[2, 3, 4], [8]]
    assert load_block_ids(ATTN_MAMBA, ids, 16, 16) == [[], []]
