"""vLLM's per-layer KV-cache tensors as the regions a worker registers, in one order every rank agrees on.

The daemon stores a block's value as its slices of every region of the group, in registration order, so the
order is part of the stored format: group order (the session's), then the layer order vLLM lists for the group,
then the parts of one layer (K before V for a split attention cache; a recurrent layer's state tensors in vLLM's
order), then each part's dense pieces (`descriptions.dense_pieces`: one for vLLM's LBHNC, LBNHC, BLHNC and BLNHC views,
one per head, in head order, for LHBNC and BHLNC; padding at a page's end is never part of a piece). Ranks that
hold byte-identical groups must produce byte-identical values, and they do because vLLM gives every rank the same
layer names in the same order. The order is versioned (REGION_ORDER, part of the value identity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvsidecar_client.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

__all__ = ["REGION_ORDER", "head_dim_of", "layer_parts", "regions_of"]

# Bump when the order above changes: values registered in the old order then never match.
REGION_ORDER = 1


def layer_parts(name: str, cache: Any, num_blocks: int) -> list[torch.Tensor]:
    """One layer's cache as tensors whose dim 0 indexes vLLM's blocks.

    Accepted shapes: (num_blocks, ...); (2, num_blocks, ...) split into K and V; (num_blocks * k, ...) for kernel
    blocks, viewed as (num_blocks, k, ...); a list or tuple of such tensors (recurrent states).
    """
    import torch

    if isinstance(cache, (list, tuple)):
        return [part for item in cache for part in layer_parts(name, item, num_blocks)]
    if not isinstance(cache, torch.Tensor):
        raise InvalidRequest(f"layer {name}: expected a tensor or a list of tensors, got {type(cache).__name__}")
    if cache.dim() >= 2 and cache.shape[0] == 2 and cache.shape[1] == num_blocks and num_blocks != 2:
        return [cache[0], cache[1]]
    if cache.dim() >= 1 and cache.shape[0] == num_blocks:
        return [cache]
    if cache.dim() >= 1 and cache.shape[0] > num_blocks and cache.shape[0] % num_blocks == 0:
        return [cache.unflatten(0, (num_blocks, -1))]  # type: ignore[no-untyped-call]
    raise InvalidRequest(
        f"layer {name}: cannot find vLLM's {num_blocks} blocks in a cache of shape {tuple(cache.shape)} "
        "(expected dim 0, or dim 1 after a K/V dim of 2)"
    )


def regions_of(
    kv_caches: Mapping[str, Any],
    layers_of_group: Sequence[Sequence[str]],
    num_blocks: int,
) -> tuple[list[torch.Tensor], list[tuple[int, ...]], list[str]]:
    """(tensors, groups_of_tensor, layer of each tensor) to register: each session group's layers' parts, in order."""
    tensors: list[torch.Tensor] = []
    groups: list[tuple[int, ...]] = []
    names: list[str] = []
    for g, layers in enumerate(layers_of_group):
        if not layers:
            raise InvalidRequest(f"session group {g} has no layers")
        for name in layers:
            if name not in kv_caches:
                raise InvalidRequest(f"vLLM registered no KV cache for layer {name} of session group {g}")
            for part in layer_parts(name, kv_caches[name], num_blocks):
                tensors.append(part)
                groups.append((g,))
                names.append(name)
    return tensors, groups, names


def head_dim_of(name: str, part: torch.Tensor, heads: int) -> int | None:
    """The dim of a layer part holding the rank's KV heads, where its group's values are cut by heads (rule 11).

    vLLM's attention parts are (blocks, ...) over block_size tokens, the rank's KV heads and the head size, in the
    backend's order; the heads are the one dim of that size. None where nothing is cut (one head on this rank).
    """
    if heads <= 1:
        return None
    dims = [d for d in range(1, part.dim()) if part.shape[d] == heads]
    if len(dims) != 1:
        raise InvalidRequest(
            f"layer {name}: cannot tell which dim of a cache part of shape {tuple(part.shape)} holds this rank's "
            f"{heads} KV heads ({len(dims)} dims have that size); share_across_tp cannot cut its values by head"
        )
    return dims[0]
