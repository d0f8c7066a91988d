"""SGLang's host pools as pages the daemon stores: each page's byte runs in the pool's buffers, and what they mean.

A stored value is one page: its runs in the order SGLang's own `get_data_page` flattens a page (K before V, layer
after layer; a Mamba state's temporal tensor, then each conv tensor, then its side states), so a value is byte for
byte the page SGLang would write to a file. Which runs a KV layout has is one table (`_LAYOUTS`): for each host pool
class and `--hicache-mem-layout`, how many outer dims come before the token (or page) dim of `kv_buffer`; a Mamba
pool's page is one slot of each of its buffers. Every rank of one engine builds the same runs. The value identity
(docs/values.md) digests the runs with everything else that decides what the bytes mean.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsidecar_client.descriptions import region_geometry
from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.vllm.identity import weights_sample

if TYPE_CHECKING:
    import torch

__all__ = ["PAGE_FORMAT", "PagePool", "PageRun", "page_pool", "pool_buffers", "value_identity"]

# Bump when the order or cut of a page's runs changes: values stored in the old format then never match.
PAGE_FORMAT = 1

# (host pool class, layout) -> (dims of kv_buffer before its token or page dim, "tokens" or "pages").
_LAYOUTS: dict[tuple[str, str], tuple[int, str]] = {
    ("MHATokenToKVPoolHost", "layer_first"): (2, "tokens"),  # (2, layers, tokens, heads, dim)
    ("MHATokenToKVPoolHost", "page_first"): (1, "tokens"),  # (2, tokens, layers, heads, dim)
    ("MHATokenToKVPoolHost", "page_first_direct"): (1, "pages"),  # (2, pages, layers, page, heads, dim)
    ("MHATokenToKVPoolHost", "page_head"): (1, "pages"),  # (2, pages, heads, page, layers, dim)
    ("MLATokenToKVPoolHost", "layer_first"): (1, "tokens"),  # (layers, tokens, 1, dim)
    ("MLATokenToKVPoolHost", "page_first"): (0, "tokens"),  # (tokens, layers, 1, dim)
    ("MLATokenToKVPoolHost", "page_first_direct"): (0, "pages"),  # (pages, layers, page, 1, dim)
    ("MambaPoolHost", "page_first"): (0, "slots"),  # each buffer (slots, layers, 1, *state)
    ("MambaPoolHost", "page_first_direct"): (0, "slots"),
}
# (host pool class, SGLang's pool name) -> the daemon's group kind.
_KINDS = {
    ("MHATokenToKVPoolHost", "kv"): "full_attention",
    ("MLATokenToKVPoolHost", "kv"): "mla",
    ("MHATokenToKVPoolHost", "swa"): "sliding_window",
    ("MLATokenToKVPoolHost", "swa"): "sliding_window_mla",
    ("MambaPoolHost", "mamba"): "mamba",
}
# Geometry attributes that decide what a page's bytes are, per pool class.
_GEOMETRY = {
    "MHATokenToKVPoolHost": ("layer_num", "head_num", "head_dim", "v_head_dim"),
    "MLATokenToKVPoolHost": ("layer_num", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim"),
    "MambaPoolHost": (
        "num_mamba_layers", "temporal_state_shape", "temporal_dtype", "conv_state_shapes", "conv_dtype",
    ),
}  # fmt: skip
# Config fields that name or locate a checkpoint without changing what it computes.
_NAMING_FIELDS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


@dataclass(frozen=True)
class PageRun:
    """One byte range of every page: page p's is [offset + p * stride, + size) of the pool's buffer `buffer`."""

    buffer: int
    offset: int
    stride: int
    size: int


@dataclass(frozen=True)
class PagePool:
    """A host pool as the daemon sees it: SGLang's name for it, the daemon's group kind, host indices per page (tokens;
    one state slot for Mamba), pages, each page's runs, its KV heads."""

    name: str
    kind: str
    page_size: int
    num_pages: int
    runs: tuple[PageRun, ...]
    heads: int
    description: tuple[tuple[str, str], ...]

    @property
    def page_bytes(self) -> int:
        """Bytes of one stored value."""
        return sum(run.size for run in self.runs)


def pool_buffers(pool: Any) -> list[torch.Tensor]:
    """The tensors SGLang allocated for a host pool, the ones the runs index: its KV buffer, or a Mamba pool's
    temporal, conv and side-state buffers (those with any bytes)."""
    buffers = pool.kv_buffer
    return [b for b in buffers if b.numel()] if isinstance(buffers, (list, tuple)) else [buffers]


def page_pool(name: str, pool: Any) -> PagePool:
    """The runs of one of SGLang's host pools under its pool name, refused with the reason where it is not stored."""
    cls = type(pool).__name__
    layout = str(pool.layout)
    shape = _LAYOUTS.get((cls, layout))
    kind = _KINDS.get((cls, name))
    if shape is None or kind is None:
        supported = sorted(f"{k[1]}: {k[0]} {lay}" for k in _KINDS for c, lay in _LAYOUTS if c == k[0])
        raise InvalidRequest(f"KVSidecarStorage cannot store {name}: {cls} {layout}; it stores {supported}")
    outer, unit = shape
    page_size, num_pages = int(pool.page_size), int(pool.page_num)
    runs = []
    for index, buffer in enumerate(pool_buffers(pool)):
        for part in itertools.product(*(range(n) for n in buffer.shape[:outer])):
            view = buffer[part] if part else buffer
            if unit == "tokens":
                if view.shape[0] != num_pages * page_size:
                    raise InvalidRequest(f"{cls} {layout}: {view.shape[0]} tokens are not {num_pages} pages")
                view = view.unflatten(0, (num_pages, page_size))  # type: ignore[no-untyped-call]
            elif view.shape[0] != num_pages:
                raise InvalidRequest(f"{cls} {layout}: {view.shape[0]} {unit}, the pool says {num_pages}")
            geometry = region_geometry(view)
            runs.append(PageRun(index, geometry.offset, geometry.block_stride, geometry.block_bytes))
    heads = int(pool.head_num) if kind in ("full_attention", "sliding_window") else 1
    described = {attr: str(getattr(pool, attr)) for attr in _GEOMETRY[cls]}
    described.update(pool=cls, layout=layout, dtype=str(pool.dtype), page_size=str(page_size))
    if cls == "MambaPoolHost":
        described.update(side_states=str([(tuple(b.shape[1:]), str(b.dtype)) for b in pool.slot_state_buffers]))
    return PagePool(name, kind, page_size, num_pages, tuple(runs), heads, tuple(sorted(described.items())))


def _model_part(model: str, pinned: str) -> dict[str, Any]:
    """What the model computes: the operator's pin, else its config and a weights sample (or its name alone)."""
    if pinned:
        return {"pinned": pinned}
    config_path = os.path.join(model, "config.json")
    config: Any = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as file:
            loaded = json.load(file)
        if isinstance(loaded, dict):
            loaded = {k: v for k, v in loaded.items() if k not in _NAMING_FIELDS}
        config = hashlib.sha256(json.dumps(loaded, sort_keys=True, default=str).encode()).hexdigest()
    # A hub name identifies nothing beyond itself: pin model_identity where nodes may resolve it differently.
    return {"config": config, "weights": weights_sample(model) or f"name:{model}"}


def value_identity(model: str, pools: Sequence[PagePool], *, pinned: str = "") -> str:
    """The digest sent as the session's value identity: the model, and every pool's page format, in group order.

    The engine family is part of it: an SGLang page and a vLLM block are laid out differently even where their
    sizes agree, so the two never share a value (docs/sglang.md).
    """
    parts = {
        "engine": "sglang",
        "page_format": PAGE_FORMAT,
        "model": _model_part(model, pinned),
        "pools": [[dict(p.description), [run.size for run in p.runs]] for p in pools],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
