"""Rules 5, 6, 8 and 9 without keys: which blocks a Load writes and which values a Save stores, per group.

The daemon's save and load plans (chunks.py) and the vLLM connector's checks are both built on these functions,
so what the connector thinks a request touches is what the daemon does. Nothing here derives a key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.layout import MAX_TOKENS, GroupSpec, Layout


def span(group: GroupSpec, dcp_size: int) -> int:
    """Rule 6: tokens one physical block covers; attention blocks are striped over D ranks under DCP."""
    return group.block_size if group.recurrent else group.block_size * dcp_size


def fine_lookup(group: GroupSpec) -> bool:
    """Whether vLLM's manager for the group can end a hit inside a block (full attention, MLA, Mamba: yes).

    vLLM's SlidingWindowManager has no fine-grained lookup: its hits always end on its own block boundaries.
    """
    return not any(k.sliding for k in group.members)


def fine_grained(groups: tuple[GroupSpec, ...], spans: tuple[int, ...], hash_block_size: int, dcp_size: int) -> bool:
    """Rule 9 as vLLM derives it (kv_cache_utils.partial_hash_hits_enabled): hits may end inside a block when a
    recurrent group's state exists at every U boundary (its block is longer than U, or at least U under DCP), and
    only if every group can look up inside a block or has blocks of U tokens (a sliding window turns them off)."""
    u = hash_block_size
    pairs = list(zip(groups, spans, strict=True))
    wide = any(g.recurrent and (s > u or (dcp_size > 1 and s >= u)) for g, s in pairs)
    return wide and all(fine_lookup(g) or s == u for g, s in pairs)


def alignment(layout: Layout) -> tuple[bool, int]:
    """Rule 9: (fine-grained hits, alignment unit), as vLLM resolves them, or as the engine said it resolved them.

    Without fine-grained hits vLLM aligns to the least common multiple of every group's span. The engine may have
    groups the store does not see (their block sizes are in its lcm), so the alignment it sends wins; it must still
    be a multiple of every span seen here.
    """
    dcp, u = layout.parallel.dcp_size, layout.hash_block_size
    spans = tuple(span(g, dcp) for g in layout.groups)
    given = layout.hit_alignment_tokens
    if layout.fine_grained_hits is not None:
        fine = layout.fine_grained_hits
    else:
        fine = fine_grained(layout.groups, spans, u, dcp) and given in (0, u)
    lcm = math.lcm(*spans)
    unit = given or (u if fine else lcm)
    if not fine and unit % lcm:
        raise InvalidLayout(
            f"hit_alignment_tokens {unit} is not a multiple of every group's span (their least common multiple is "
            f"{lcm}): without fine-grained hits a hit must end on a block boundary of every group"
        )
    if unit > MAX_TOKENS:
        raise InvalidLayout(
            f"hits would be aligned to {unit} tokens (the spans' least common multiple), past {MAX_TOKENS}"
        )
    return fine, unit


def mid_block(group: GroupSpec, span: int, hash_block_size: int, fine: bool) -> bool:
    """Whether hits may end inside this group's blocks: fine-grained hits, a manager that can look inside, and
    blocks longer than U."""
    return fine and fine_lookup(group) and span > hash_block_size


def first_needed_block(group: GroupSpec, hit_tokens: int, span: int) -> int:
    """Rule 8: the first block a hit needs. A window of W needs the last W - 1 tokens before the next one, as vLLM's
    sliding window counts them (get_num_skipped_tokens: hit - W + 1 tokens are skipped), and at least the block
    ending at the hit (vLLM's sliding-window manager never hits on no cached block, even with W = 1)."""
    window = group.attention_window
    return 0 if window is None else max(0, (hit_tokens - max(window, 2) + 1) // span)


def load_spans(group: GroupSpec, span: int, hit_tokens: int, start_tokens: int = 0) -> range:
    """Rule 8: the span indices a Load of hit_tokens writes for one group, the engine already holding start_tokens.

    Attention reads every block from 0 (or from the window's first block) to the one holding the hit end; a group
    with no attention member reads only the state at the hit end. Blocks ending at or before start_tokens are kept.
    """
    if hit_tokens <= start_tokens:
        return range(0)
    last = (hit_tokens - 1) // span
    first = first_needed_block(group, hit_tokens, span) if group.attention else last
    return range(max(first, start_tokens // span), last + 1)


def save_spans(
    group: GroupSpec, span: int, hash_block_size: int, mid: bool, num_tokens: int, saved_tokens: int = 0
) -> list[tuple[int, int]]:
    """Rule 5: (span index, boundary) of every value a Save of (saved_tokens, num_tokens] stores for one group.

    Each complete block is stored under its end; the partial last block (attention tokens, or the recurrent state)
    under the last U boundary only where hits may end inside the group's blocks (`mid`, see mid_block): no lookup
    would ever ask for it otherwise.
    """
    s, u = span, hash_block_size
    out = [(k, (k + 1) * s) for k in range(saved_tokens // s, num_tokens // s)]
    last = num_tokens - num_tokens % u
    if last % s and last > saved_tokens and mid:
        out.append((last // s, last))
    return out


@dataclass(frozen=True, slots=True)
class Spans:
    """The key-free part of a layout's placement: each group's span, mid-block hits, and the hit unit."""

    groups: tuple[GroupSpec, ...]
    spans: tuple[int, ...]
    hash_block_size: int
    fine_grained: bool
    unit: int  # hit lengths are multiples of this (rule 9)
    mid: tuple[bool, ...] = ()  # per group: hits may end inside its blocks (mid_block)

    @classmethod
    def of(cls, layout: Layout) -> Spans:
        """The spans of a validated layout (the same on every rank of the engine)."""
        dcp, u = layout.parallel.dcp_size, layout.hash_block_size
        spans = tuple(span(g, dcp) for g in layout.groups)
        fine, unit = alignment(layout)
        mid = tuple(mid_block(g, s, u, fine) for g, s in zip(layout.groups, spans, strict=True))
        return cls(layout.groups, spans, u, fine, unit, mid)

    def load(self, hit_tokens: int, start_tokens: int = 0) -> list[range]:
        """Per group, the span indices a Load of hit_tokens writes (see load_spans)."""
        return [load_spans(g, s, hit_tokens, start_tokens) for g, s in zip(self.groups, self.spans, strict=True)]

    def save(self, num_tokens: int, saved_tokens: int = 0) -> list[list[tuple[int, int]]]:
        """Per group, the (span index, boundary) values a Save of (saved_tokens, num_tokens] stores (see save_spans)."""
        u = self.hash_block_size
        rows = zip(self.groups, self.spans, self.mid, strict=True)
        return [save_spans(g, s, u, mid, num_tokens, saved_tokens) for g, s, mid in rows]
