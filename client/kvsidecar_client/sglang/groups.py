"""The session an SGLang rank opens: one group per host pool, its parallel layout and KV heads, by the daemon's rules.

Group 0 is the KV pool (`register_mem_pool_host`); the hybrid cache's side pools follow in the order SGLang
registers them (`register_mem_host_pool_v2`): a Mamba state pool (`mamba`) and a sliding-window pool (`swa`). Every
group's block is one KV page (U = the page size), so a page hash names the same boundary in each group, and the
daemon's rules say what a prefix needs (docs/placement.md rules 7-9): every KV page before it, the last pages of the
window before it, and a Mamba state at exactly it.

- MHA pools (full attention, sliding window) are per TP rank: the session is the rank at its TP size and rank, with
  H = the pool's heads x T, and every rank writes its own heads (SGLang backs them up on every rank).
- A Mamba state is per TP rank (rule 1: factor 1), written by every rank into its own namespace (SGLang backs
  it up on every rank), and a prefix needs every rank's state. It is stored per layout: SGLang's state layouts are
  not described to the daemon, so another TP size misses it rather than reading another layout's bytes.
- MLA's latent is the same bytes on every rank, and SGLang backs it up from TP rank 0 only (`is_storage_writer`):
  an engine whose pools are all latent (MLA, sliding-window MLA) opens a TP=1 session on every rank, one namespace
  rank 0 fills alone, shared by every TP size. A latent beside per-rank pools (Kimi-Linear's MLA with its state) at
  T > 1 would need a session at T, whose rule 4 stripes the latent over ranks that never write it: refused.
- A sliding window: SGLang restores the last N = ceil(W / page) pages before a prefix (its `full_window_pages`, W its
  `swa_retain_window`); the group's window is N·page + 1 tokens, so the daemon needs exactly those N pages (rule 8:
  the next token attends to the last window - 1 tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.layout import EngineLayout, GroupSpec
from kvsidecar_client.sglang.pages import PagePool

__all__ = ["SessionShape", "model_window", "session_shape"]

_LATENT = frozenset({"mla", "sliding_window_mla"})
_HEADED = frozenset({"full_attention", "sliding_window"})
_SLIDING = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(frozen=True)
class SessionShape:
    """What an SGLang rank's session says: its parallel layout, H, U, groups, and the window's pages (0: none)."""

    layout: EngineLayout
    num_kv_heads: int
    page_tokens: int
    groups: tuple[GroupSpec, ...]
    window_pages: int


def session_shape(
    pools: Sequence[PagePool], *, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int, window: int
) -> SessionShape:
    """The session of one rank whose host pools are `pools` (KV first); window: SGLang's restored SWA tokens."""
    if not pools or pools[0].name != "kv":
        raise InvalidRequest("no KV host pool registered (register_mem_pool_host)")
    page = pools[0].page_size
    kinds = [p.kind for p in pools]
    latent = all(k in _LATENT for k in kinds)
    if not latent and tp_size > 1 and any(k in _LATENT for k in kinds):
        raise InvalidRequest(
            f"KVSidecarStorage cannot store pools {[p.name for p in pools]} ({kinds}) at TP {tp_size}: SGLang backs "
            "the MLA latent up from TP rank 0 only, and a session at TP > 1, which per-rank pools need, stripes it "
            "over every rank"
        )
    heads = {p.heads for p in pools if p.kind in _HEADED}
    if len(heads) > 1:
        raise InvalidRequest(f"KVSidecarStorage needs one KV head count for its attention pools, got {sorted(heads)}")
    tp_size, tp_rank = (1, 0) if latent else (tp_size, tp_rank)
    window_pages = 0
    groups = []
    for pool in pools:
        if pool.kind in _SLIDING:
            if window < 1:
                raise InvalidRequest(
                    "a sliding-window host pool needs its window: set sliding_window (SGLang's swa_retain_window, "
                    "in tokens) in the extra config, or give a model whose config.json says sliding_window"
                )
            window_pages = -(-window // page)
            groups.append(GroupSpec(pool.kind, page, window=window_pages * page + 1))
        else:
            groups.append(GroupSpec(pool.kind, page))
    layout = EngineLayout(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank)
    num_kv_heads = heads.pop() * tp_size if heads else 1
    return SessionShape(layout, num_kv_heads, page, tuple(groups), window_pages)


def model_window(model: str) -> int:
    """The model's sliding window from its config.json (top level or its text config), 0 where it says none."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    for part in (config, config.get("text_config") or {}):
        window = part.get("sliding_window") if isinstance(part, dict) else None
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            return window
    return 0
