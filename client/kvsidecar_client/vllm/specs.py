"""vLLM's KV-cache configuration, read as what a kvsidecar session says: groups, hash block size, parallel layout.

Pure: vLLM config objects in, kvsidecar value types out; no I/O, no daemon. The one impure helper,
`layout_of_this_rank`, asks vLLM's distributed state for the rank and is kept apart for that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.layout import EngineLayout, GroupSpec
from kvsidecar_contract.placement import RecurrentState

__all__ = [
    "EngineGroups",
    "StateOf",
    "UnsupportedSpec",
    "engine_groups",
    "group_spec",
    "hash_block_size",
    "hash_bytes",
    "hit_alignment",
    "layout_of_this_rank",
    "parallel_layout",
    "spec_kind",
]


# One MambaSpec's state layout (rule 12), or None: kept per layout.
StateOf = Callable[[MambaSpec], RecurrentState | None]


class UnsupportedSpec(InvalidRequest):
    """A KV-cache group whose kind kvsidecar cannot store (it would make hits restore only part of the state)."""


@dataclass(frozen=True)
class EngineGroups:
    """The groups a session declares, and which vLLM group each one is (vLLM may have groups kvsidecar skips)."""

    specs: tuple[GroupSpec, ...]
    vllm_group_ids: tuple[int, ...]  # specs[i] is vLLM's kv_cache_groups[vllm_group_ids[i]]
    num_vllm_groups: int

    def select(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The session's block ids (one list per session group) out of vLLM's per-group block ids."""
        if len(block_ids) != self.num_vllm_groups:
            raise InvalidRequest(f"expected block ids for {self.num_vllm_groups} vLLM groups, got {len(block_ids)}")
        return [list(block_ids[g]) for g in self.vllm_group_ids]


def spec_kind(spec: KVCacheSpec) -> tuple[str, int]:
    """(kind, window) of one layer spec. Subclasses first: SlidingWindowMLASpec is a SlidingWindowSpec."""
    if isinstance(spec, SlidingWindowMLASpec):
        return "sliding_window_mla", spec.sliding_window
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window", spec.sliding_window
    if isinstance(spec, MLAAttentionSpec):
        return "mla", 0
    if isinstance(spec, FullAttentionSpec):
        # With the hybrid allocator off, vLLM stores sliding-window layers as full attention (blocks for every
        # token) and only computes them windowed: every block is there, so full attention is the right rule.
        return "full_attention", 0
    if isinstance(spec, MambaSpec):
        return "mamba", 0
    raise UnsupportedSpec(f"kvsidecar cannot store a KV-cache group of {type(spec).__name__}")


def group_spec(spec: KVCacheSpec, state_of: StateOf | None = None) -> GroupSpec:
    """The session's GroupSpec for one vLLM group spec; a uniform group is unwrapped one level.

    state_of describes a MambaSpec group's state layout (rule 12: `states.describe_state`), where the session shares
    values across TP sizes; without it, or where it answers None, the state is opaque and kept per layout.
    """
    if isinstance(spec, MambaSpec) and state_of is not None:
        return GroupSpec("mamba", spec.block_size, state=state_of(spec))
    if isinstance(spec, UniformTypeKVCacheSpecs):
        members = [spec_kind(inner) for inner in spec.kv_cache_specs.values()]
        if not members:
            raise UnsupportedSpec("a UniformTypeKVCacheSpecs group with no layers")
        kinds = tuple(dict.fromkeys(kind for kind, _ in members))
        window = max(window for _, window in members)
        if len(kinds) == 1:
            return GroupSpec(kinds[0], spec.block_size, window)
        return GroupSpec("uniform", spec.block_size, window, inner=kinds)
    kind, window = spec_kind(spec)
    return GroupSpec(kind, spec.block_size, window)


def engine_groups(kv_cache_config: KVCacheConfig, state_of: StateOf | None = None) -> EngineGroups:
    """The groups a hash-addressed store holds, in vLLM's order: those vLLM transfers and prefix-caches.

    vLLM restores the others itself (get_loaded_kv_cache_group_ids defaults to prefix_cacheable_group_ids):
    groups with enable_kv_transfer=False are replicas rebuilt from their source group, and groups that are not
    prefix-cacheable (a bounded-replay sliding window, a ring buffer) are recomputed after a hit. A group that is
    cacheable but of a kind kvsidecar cannot store is an error: a hit would restore only part of the state.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    specs: list[GroupSpec] = []
    ids: list[int] = []
    for gid, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        if not getattr(group.kv_cache_spec, "prefix_cacheable", True):
            continue
        specs.append(group_spec(group.kv_cache_spec, state_of))
        ids.append(gid)
    if not specs:
        raise UnsupportedSpec("the model has no prefix-cacheable KV-cache group for kvsidecar to store")
    return EngineGroups(tuple(specs), tuple(ids), len(groups))


def hash_block_size(kv_cache_config: KVCacheConfig, vllm_config: Any) -> int:
    """U: tokens per entry of `request.block_hashes`, exactly as vLLM's engine core resolves it."""
    if kv_cache_config.hash_block_size:
        return int(kv_cache_config.hash_block_size)
    # A KVCacheConfig built before the engine core resolved it (tests, tools): resolve it the same way.
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def hit_alignment(kv_cache_config: KVCacheConfig, vllm_config: Any) -> tuple[int, bool]:
    """(tokens every prefix-cache hit is a multiple of, whether hits may end inside a block), as vLLM has them.

    vLLM's engine core resolves `cache_hit_alignment_tokens` into the KV-cache config and its coordinator lands
    hits on it: the hash block size when fine-grained partial hits are on (an "align"-mode Mamba group and managers
    that can all look up inside a block; a sliding window turns them off), else the least common multiple of every
    group's block size, groups kvsidecar does not store included. External hits must land exactly there too.
    """
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

    scheduler_block_size, resolved_unit = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    unit = int(kv_cache_config.hash_block_size or resolved_unit)
    alignment = kv_cache_config.cache_hit_alignment_tokens
    if not alignment:
        # A KVCacheConfig built before the engine core resolved it (tests, tools): resolve it the same way.
        alignment = resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, scheduler_block_size, unit)
    alignment = int(alignment)
    # vLLM's coordinator aligns to the hash block exactly when partial hash hits are on (or when every block is one
    # hash block long, where the two coincide).
    return alignment, alignment == unit and alignment < scheduler_block_size


def hash_bytes(algorithm: str) -> int:
    """Length of one block hash under vLLM's prefix_caching_hash_algo (32 for sha256, 16 for xxhash)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return len(get_hash_fn_by_name(algorithm)(b""))


def parallel_layout(
    parallel_config: Any, *, tp_rank: int = 0, pp_rank: int = 0, pcp_rank: int = 0, dcp_rank: int | None = None
) -> EngineLayout:
    """The session's EngineLayout: sizes from vLLM's ParallelConfig, ranks as given."""
    return EngineLayout(
        tp_size=int(parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        pp_size=int(parallel_config.pipeline_parallel_size),
        pp_rank=pp_rank,
        pcp_size=int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1),
        pcp_rank=pcp_rank,
        dcp_size=int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1),
        dcp_rank=dcp_rank,
    )


def layout_of_this_rank(parallel_config: Any) -> EngineLayout:
    """This worker's layout, its ranks read from vLLM's distributed state.

    Without an initialized distributed state (a single-process engine, a test) the ranks are 0, which is only
    right when every parallel size is 1; otherwise the rank cannot be known, and guessing it would load another
    rank's shard, so that is an error.
    """
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        # Every rank as vLLM's parallel state defines it (rank_in_group of its TP, PP, PCP and DCP groups), never
        # derived from the global rank here: the daemon checks them against vLLM's layout and refuses a mismatch.
        pcp_rank = ps.get_pcp_group().rank_in_group if getattr(ps, "_PCP", None) is not None else 0
        dcp_rank = ps.get_dcp_group().rank_in_group if getattr(ps, "_DCP", None) is not None else None
        return parallel_layout(
            parallel_config,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pp_group().rank_in_group,
            pcp_rank=pcp_rank,
            dcp_rank=dcp_rank,
        )
    layout = parallel_layout(parallel_config)
    if (layout.tp_size, layout.pp_size, layout.pcp_size) != (1, 1, 1):
        raise InvalidRequest(
            f"vLLM's distributed state is not initialized, so this worker's rank is unknown "
            f"(tp={layout.tp_size}, pp={layout.pp_size}, pcp={layout.pcp_size}); create the connector's worker "
            "side after init_distributed_environment"
        )
    return layout
