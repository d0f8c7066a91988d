"""vLLM 0.33's own KV-cache planning and allocation on CPU, with the one backing buffer in shared memory.

vLLM allocates every layer's cache as views of ONE `torch.zeros(n, dtype=torch.int8)` (v1/worker/utils.py
`allocate_kv_cache`); serving that call from `shared_tensor` makes the cache mappable by the daemon with nothing in
vLLM changed, so the views under test are exactly the ones vLLM hands a connector.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvsidecar_client.allocation import SharedMemoryAllocation


def plan(config: VllmConfig, specs: dict[str, KVCacheSpec], layout: KVCacheLayout, num_blocks: int) -> KVCacheConfig:
    """vLLM's grouping and tensor plan for these layer specs under `layout` (raises vLLM's own refusal)."""
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_kv_cache_groups(config, specs)
    kv = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 40)
    # What vLLM's engine core resolves next (v1/engine/core.py): a plan it cannot resolve never reaches a connector.
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
    kv.hash_block_size = hash_block_size
    kv.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv, config, scheduler_block_size, hash_block_size
    )
    return kv


def allocate(kv: KVCacheConfig, layout: KVCacheLayout, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vLLM's own per-layer views; on CPU their backing buffer is a shared-memory segment."""
    if device == "cpu":
        with SharedMemoryAllocation():
            return allocate_kv_cache(kv, torch.device("cpu"), layout)
    return allocate_kv_cache(kv, torch.device(device), layout)
