"""SGLang's own host pools on CPU, as its HiCache controller builds them (pin_memory off: no CUDA here), and its
backend factory with the documented extra config. Imports SGLang: only for tests that skip without it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvsidecar_client.sglang.pages import pool_buffers

__all__ = ["LAYERS", "PAGE", "backend", "extra_config", "fill", "host_pool", "mamba_pool", "model_dir", "page_bytes"]

LAYERS, PAGE, DEVICE_TOKENS = 2, 4, 64
HEADS, HEAD_DIM = 2, 8
KV_LORA_RANK, ROPE_DIM = 32, 8


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def host_pool(
    kind: str,
    layout: str,
    *,
    allocator: str = "shm",
    dtype: torch.dtype = torch.bfloat16,
    layers: int = LAYERS,
    page: int = PAGE,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    tokens: int = DEVICE_TOKENS,
    ratio: float = 2.0,
) -> Any:
    """An MHA or MLA host pool of SGLang's (ratio x tokens), over CPU "device" buffers of `tokens`, allocated by
    SGLang's own allocator; MLA rows are KV_LORA_RANK + ROPE_DIM wide."""
    cpu = torch.device("cpu")
    if kind == "mha":
        k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        buffers = KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD)
        info = MHABufferInfo(
            buffers=buffers, page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
            device=cpu,
        )  # fmt: skip
        return MHATokenToKVPoolHost(
            info, ratio, 0, page, layout, pin_memory=False, device="cpu", allocator_type=allocator,
            device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
        )  # fmt: skip
    rows = tuple(torch.zeros(tokens, 1, KV_LORA_RANK + ROPE_DIM, dtype=dtype) for _ in range(layers))
    minfo = MLABufferInfo(
        buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(layers)), device_layer_num=layers,
        page_size=page, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, kv_cache_dim=KV_LORA_RANK + ROPE_DIM,
        dtype=dtype, device=cpu,
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        minfo, ratio, 0, page, layout, pin_memory=False, device="cpu", allocator_type=allocator,
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers, target_layer_num=layers,
    )  # fmt: skip


def mamba_pool(*, allocator: str = "shm", layers: int = LAYERS, slots: int = 8) -> Any:
    """A Mamba state host pool of SGLang's (2 x slots state slots) over CPU "device" states of `slots`: a Mamba2-like
    temporal state (heads, head dim, state) in fp32 and one conv state (window, channels) in bf16 per layer."""
    temporal = torch.zeros(layers, slots, 2, 4, 8, dtype=torch.float32)
    conv = (torch.zeros(layers, slots, 3, 24, dtype=torch.bfloat16),)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", allocator_type=allocator,
        layout="page_first",
    )  # fmt: skip


def fill(pool: Any, seed: int) -> None:
    """Random bytes in every page of the pool (a seed per writer, so ranks' pages differ)."""
    generator = torch.Generator().manual_seed(seed)
    for buffer in pool_buffers(pool):
        flat = buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


def page_bytes(pool: Any, page: int) -> bytes:
    """Page `page` of a pool as SGLang's own get_data_page flattens it (a Mamba pool's page is one state slot)."""
    return bytes(pool.get_data_page(page * pool.page_size).view(torch.uint8).numpy())


def model_dir(root: Path) -> Path:
    """A model directory with only a config.json, as SGLang's model path."""
    path = root / "tiny-model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": LAYERS}))
    return path


def extra_config(socket: str, **more: Any) -> dict[str, Any]:
    """The documented extra config (docs/sglang.md)."""
    return {
        "backend_name": "kvsidecar", "module_path": "kvsidecar_client.sglang", "class_name": "KVSidecarStorage",
        "interface_v1": 1, "allocator": "shm", "socket": socket, **more,
    }  # fmt: skip


def backend(
    pool: Any,
    model: str,
    extra: Mapping[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    name: str = "dynamic",
    side_pools: Mapping[str, Any] | None = None,
) -> Any:
    """A backend as SGLang attaches it: built by its factory (`dynamic`: our loader; or a built-in such as
    `mooncake`), then given the pool and, as the hybrid cache controller does, each side pool by name."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=pool.layout.startswith("page_first"), model_name=model,
        extra_config=dict(extra),
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend(name, config, pool)
    storage.register_mem_pool_host(pool)
    storage.register_mem_host_pool_v2(pool, "kv")
    for pool_name, side in (side_pools or {}).items():
        storage.register_mem_host_pool_v2(side, pool_name)
    storage.on_host_pools_registered()
    return storage
