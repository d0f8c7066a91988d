"""Every KV-cache layout vLLM 0.33 allocates is registered and moved byte for byte through a real daemon.

The caches are vLLM's own: its planner (`get_kv_cache_groups`, `get_kv_cache_config_from_groups`) and its allocator
(`allocate_kv_cache`) for each `KVCacheLayout`, with the one backing buffer in shared memory. The connector
registers them as vLLM would hand them over, saves some blocks, loads them into other blocks, and every byte of the
target blocks must equal the source's while no byte outside them (padding, other layers, other blocks) changes.

KVSIDECAR_TEST_DEVICE=cuda runs the same on a GPU: vLLM allocates on CUDA and the client shares the tensors over
CUDA IPC (the vllm section of scripts/gpu-check.sh).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

import torch
from sidecar_engine import BLOCK, vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_alloc import allocate, plan

from kvsidecar_client.descriptions import dense_pieces
from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.results import SessionInfo
from kvsidecar_client.vllm import KVSidecarConnector
from kvsidecar_client.vllm.metadata import KVSidecarMetadata, LoadSpec, SaveSpec
from kvsidecar_client.vllm.specs import engine_groups

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEVICE = os.environ.get("KVSIDECAR_TEST_DEVICE", "cpu")
F16 = torch.float16
NUM_BLOCKS = 64
HASHES = tuple(bytes([i]) * 32 for i in range(1, 5))  # four blocks of 16 tokens


def full(heads: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=8, dtype=F16)


MLA = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=F16)
SLIDING = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=F16, sliding_window=32)
MAMBA = MambaSpec(block_size=BLOCK, shapes=((3, 8), (2, 4, 4)), dtypes=(F16, F16), mamba_cache_mode="align")

# A tiny GraniteMoeHybrid (Mamba2: 4 heads, one B/C group) whose state vLLM's own model code sizes: with
# share_across_tp the connector describes it (placement rule 12) and the daemon cuts it into 5 pieces.
GRANITE = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 16,
    "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"], "mamba_expand": 1, "mamba_n_heads": 4, "mamba_d_head": 4,
    "mamba_n_groups": 1, "mamba_d_state": 4, "mamba_d_conv": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}  # fmt: skip


def _granite_mamba() -> MambaSpec:
    from transformers import GraniteMoeHybridConfig
    from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM

    hf = GraniteMoeHybridConfig(**{k: v for k, v in GRANITE.items() if k not in ("architectures", "model_type")})
    cache = SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", use_replayssm=False)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=cache, num_speculative_tokens=0,
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=F16),
    )  # fmt: skip
    shapes = GraniteMoeHybridForCausalLM.get_mamba_state_shape_from_config(config)
    dtypes = GraniteMoeHybridForCausalLM.get_mamba_state_dtype_from_config(config)
    return MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")


GRANITE_MAMBA = _granite_mamba()

CONFIGS: dict[str, dict[str, KVCacheSpec]] = {
    "full-h1": {"l0": full(1), "l1": full(1)},
    "full-h2": {"l0": full(2), "l1": full(2)},
    "full-h8": {"l0": full(8), "l1": full(8)},
    "mla": {"l0": MLA, "l1": MLA},
    "sliding-h2": {"l0": SLIDING, "l1": SLIDING},
    "mamba": {"l0": MAMBA, "l1": MAMBA},
    "full-h2+mamba": {"a0": full(2), "a1": full(2), "m0": MAMBA, "m1": MAMBA},
    "full-h2+granite": {"a0": full(2), "a1": full(2), "m0": GRANITE_MAMBA, "m1": GRANITE_MAMBA},
    "full-h8+sliding-h8": {
        "a0": full(8),
        "s0": SlidingWindowSpec(block_size=BLOCK, num_kv_heads=8, head_size=8, dtype=F16, sliding_window=32),
    },
}


def _blocks_loaded(spec: KVCacheSpec) -> int:
    """How many of the hit's last blocks a load writes: the state at the hit (recurrent), the window (sliding)."""
    members = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
    if any(isinstance(s, MambaSpec) for s in members):
        return 1
    windows = [s.sliding_window for s in members if isinstance(s, SlidingWindowSpec)]
    return -(-max(windows) // BLOCK) if windows else len(HASHES)


def _byte_view(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.uint8) if view.dtype != torch.uint8 else view


def _poll(connector: KVSidecarConnector, finished: set[str], want: str) -> None:
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        sending, recving = connector.get_finished(finished)
        if want in (sending or set()) | (recving or set()):
            return
        time.sleep(0.01)
    raise AssertionError(f"{want} was never reported finished")


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_vllm_layout_round_trips_byte_for_byte(vllm_env, tiny_model, daemon, cache_prefix, name, layout):
    round_trip(tiny_model, daemon, cache_prefix, name, layout)


# Layouts whose blocks hold their KV heads, outermost once K and V are apart: attention values cut per KV head
# (placement rule 11) are then one range of each region. Written by hand from vLLM's KVCacheLayout names.
HEAD_MAJOR = {"LBHNC", "BLHNC"}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("name", ["full-h2", "sliding-h2", "full-h2+mamba", "mla"])  # the tiny model's 2 KV heads
def test_sharing_across_tp_sizes_cuts_head_major_layouts_and_refuses_the_others(
    vllm_env, tiny_model, daemon, cache_prefix, name, layout
):
    # MLA's latent is never cut (vLLM's MLAAttentionSpec is a FullAttentionSpec: tell it apart first).
    cut = any(
        isinstance(s, (FullAttentionSpec, SlidingWindowSpec)) and not isinstance(s, MLAAttentionSpec)
        for s in CONFIGS[name].values()
    )
    if cut and layout.name not in HEAD_MAJOR:
        with pytest.raises(InvalidRequest, match="share values across TP sizes with a"):
            round_trip(tiny_model, daemon, cache_prefix, name, layout, share=True)
    else:
        round_trip(tiny_model, daemon, cache_prefix, name, layout, share=True)


@pytest.fixture(scope="module")
def granite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GraniteMoeHybrid model directory with only its config.json."""
    path = tmp_path_factory.mktemp("models") / "tiny-granite"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(GRANITE))
    return path


@pytest.mark.parametrize("layout", sorted(HEAD_MAJOR))
def test_a_hybrids_state_shared_across_tp_sizes_is_cut_in_pieces_and_round_trips_byte_for_byte(
    vllm_env, granite_model, daemon, cache_prefix, layout
):
    # vLLM's own pages of a Mamba2 state (padded to the attention page), described by the connector from the model's
    # config (rule 12): the daemon accepts the regions and moves the state as its pieces, byte for byte.
    info = round_trip(granite_model, daemon, cache_prefix, "full-h2+granite", KVCacheLayout[layout], share=True)
    attention, state = info.groups
    assert (attention.shared_across_tp, attention.values_per_block) == (True, 2)
    assert (state.shared_across_tp, state.values_per_block) == (True, 5)  # 4 heads and the one B/C group


def round_trip(tiny_model, daemon, cache_prefix, name, layout, *, share: bool = False) -> SessionInfo:
    """Save four blocks of vLLM's own caches for `layout`, load them into other blocks: byte for byte, nothing else
    touched. Returns the worker's session placement."""
    specs = CONFIGS[name]
    recurrent = any(isinstance(s, MambaSpec) for s in specs.values())
    extra = {"socket": daemon.target, "cache_prefix": cache_prefix, "share_across_tp": share}
    config = vllm_config(tiny_model, extra, recurrent=recurrent)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    try:
        kv = plan(config, specs, layout, NUM_BLOCKS)
    except (ValueError, AssertionError) as refused:
        pytest.skip(f"vLLM 0.33 itself cannot plan {name} as {layout.name}: {type(refused).__name__}: {refused}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVSIDECAR_TEST_DEVICE=cuda but torch sees no GPU")
    caches = allocate(kv, layout, DEVICE)
    buffer = next(iter(caches.values()))
    assert buffer.device.type == DEVICE
    backing = torch.as_strided(_byte_view(buffer), (buffer.untyped_storage().nbytes(),), (1,), 0)
    noise = torch.randint(0, 256, backing.shape, generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    backing.copy_(noise.to(backing.device))
    groups = engine_groups(kv)
    # A block id belongs to one group at a time in vLLM (groups overlay one buffer): each group its own ids.
    source = tuple(tuple(range(4 + 8 * g, 8 + 8 * g)) for g in range(len(groups.specs)))
    target = tuple(tuple(range(40 + 8 * g, 44 + 8 * g)) for g in range(len(groups.specs)))

    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv)
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv)
    assert isinstance(worker, KVSidecarConnector) and isinstance(scheduler, KVSidecarConnector)
    try:
        worker.register_kv_caches(caches)
        reads = frozenset(b for ids in source for b in ids)
        save = SaveSpec("a", HASHES, source, BLOCK * len(HASHES), 0, reads)
        worker.bind_connector_metadata(KVSidecarMetadata(saves=[save], delayed_saves=frozenset({"a"})))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        _poll(worker, {"a"}, "a")

        hit = scheduler.client.lookup(HASHES, BLOCK * len(HASHES) + 1)
        assert hit.hit_tokens == BLOCK * len(HASHES)
        before = backing.clone()
        load = LoadSpec("b", HASHES, target, hit, 0, target)
        worker.bind_connector_metadata(
            KVSidecarMetadata(loads=[load], reused_block_ids=frozenset(b for ids in target for b in ids))
        )
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        _poll(worker, set(), "b")
        assert worker.get_block_ids_with_load_errors() == set()

        written = torch.zeros_like(backing, dtype=torch.bool)
        for g, vllm_group in enumerate(groups.vllm_group_ids):
            group = kv.kv_cache_groups[vllm_group]
            pairs = list(zip(source[g], target[g], strict=True))[-_blocks_loaded(group.kv_cache_spec) :]
            for layer in group.layer_names:
                view = _byte_view(caches[layer])
                for src, dst in pairs:
                    assert torch.equal(view[dst], view[src]), f"{layer} block {dst} differs from block {src}"
                    for piece in dense_pieces(view):
                        mark = torch.as_strided(written, piece.shape, piece.stride(), piece.storage_offset())
                        mark[dst] = True
        # Nothing outside the target blocks' registered bytes moved: not padding, not another layer or block.
        moved = ((backing != before) & ~written).nonzero().flatten()
        assert moved.numel() == 0, f"bytes outside the target blocks changed: {moved[:8].tolist()} of {moved.numel()}"
        info = worker.client.session_info
        assert info is not None
        return info
    finally:
        worker.shutdown()
        scheduler.shutdown()
