"""SGLang's host pools as pages the daemon stores: each page's byte runs in the pool's buffer, and what they mean.

A stored value is one page: its runs in the order of the pool's buffer dims (K before V, layer after layer, as
SGLang's own `get_data_page` flattens a page), so a value is byte for byte the page SGLang would write to a file.
Which runs a layout has is one table (`_LAYOUTS`): for each host pool class and `--hicache-mem-layout`, how many
outer dims come before the token (or page) dim of `kv_buffer`. Every rank of one engine builds the same runs.
The value identity (docs/values.md) digests the runs with everything else that decides what the bytes mean.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.memory import region_geometry
from kvsidecar_client.vllm.identity import weights_sample

__all__ = ["PAGE_FORMAT", "PagePool", "PageRun", "page_pool", "value_identity"]

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
}
_KINDS = {"MHATokenToKVPoolHost": "full_attention", "MLATokenToKVPoolHost": "mla"}
# Geometry attributes that decide what a page's bytes are, per pool class.
_GEOMETRY = {
    "MHATokenToKVPoolHost": ("layer_num", "head_num", "head_dim", "v_head_dim"),
    "MLATokenToKVPoolHost": ("layer_num", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim"),
}
# Config fields that name or locate a checkpoint without changing what it computes.
_NAMING_FIELDS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


@dataclass(frozen=True)
class PageRun:
    """One byte range of every page: page p's is [offset + p * stride, + size) of the pool's buffer."""

    offset: int
    stride: int
    size: int


@dataclass(frozen=True)
class PagePool:
    """A host pool as the daemon sees it: its kind of KV, tokens per page, pages, each page's runs, its heads."""

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


def page_pool(pool: Any) -> PagePool:
    """The runs of a host pool of SGLang's (MHA or MLA; layouts in `_LAYOUTS`), refused with the reason otherwise."""
    name = type(pool).__name__
    layout = str(pool.layout)
    shape = _LAYOUTS.get((name, layout))
    if shape is None:
        supported = sorted(f"{cls} {lay}" for cls, lay in _LAYOUTS)
        raise InvalidRequest(f"KVSidecarStorage cannot store a {name} with layout {layout!r}; it stores {supported}")
    outer, unit = shape
    buffer = pool.kv_buffer
    page_size, num_pages = int(pool.page_size), int(pool.page_num)
    runs = []
    for index in itertools.product(*(range(n) for n in buffer.shape[:outer])):
        view = buffer[index] if index else buffer
        if unit == "tokens":
            if view.shape[0] != num_pages * page_size:
                raise InvalidRequest(f"{name} {layout}: {view.shape[0]} tokens are not {num_pages} pages")
            view = view.unflatten(0, (num_pages, page_size))
        elif view.shape[0] != num_pages:
            raise InvalidRequest(f"{name} {layout}: {view.shape[0]} pages, the pool says {num_pages}")
        geometry = region_geometry(view)
        runs.append(PageRun(geometry.offset, geometry.block_stride, geometry.block_bytes))
    heads = int(pool.head_num) if _KINDS[name] == "full_attention" else 1
    described = {attr: str(getattr(pool, attr)) for attr in _GEOMETRY[name]}
    described.update(pool=name, layout=layout, dtype=str(pool.dtype), page_size=str(page_size))
    return PagePool(_KINDS[name], page_size, num_pages, tuple(runs), heads, tuple(sorted(described.items())))


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
