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


def fine_grained(groups: tuple[GroupSpec, ...], spans: tuple[int, ...], hash_block_size: int, dcp_size: int) -> bool:
    """Rule 9: whether hits may end inside a block (a recurrent group whose state exists at every U boundary)."""
    u = hash_block_size
    return any(g.recurrent and (s > u or (dcp_size > 1 and s >= u)) for g, s in zip(groups, spans, strict=True))


def load_spans(group: GroupSpec, span: int, hit_tokens: int, start_tokens: int = 0) -> range:
    """Rule 8: the span indices a Load of hit_tokens writes for one group, the engine already holding start_tokens.

    Attention reads every block from 0 (or from the window's first block) to the one holding the hit end; a group
    with no attention member reads only the state at the hit end. Blocks ending at or before start_tokens are kept.
    """
    if hit_tokens <= start_tokens:
        return range(0)
    last = (hit_tokens - 1) // span
    if not group.attention:
        first = last
    else:
        window = group.attention_window
        first = 0 if window is None else max(0, (hit_tokens - window) // span)
    return range(max(first, start_tokens // span), last + 1)


def save_spans(
    group: GroupSpec, span: int, hash_block_size: int, fine: bool, num_tokens: int, saved_tokens: int = 0
) -> list[tuple[int, int]]:
    """Rule 5: (span index, boundary) of every value a Save of (saved_tokens, num_tokens] stores for one group.

    Each complete block is stored under its end; the partial last block under the last U boundary, for recurrent
    state always and for attention only when hits may end mid-block. (Without fine-grained hits a recurrent span
    equals U, so that boundary is then a block end.)
    """
    s, u = span, hash_block_size
    out = [(k, (k + 1) * s) for k in range(saved_tokens // s, num_tokens // s)]
    last = num_tokens - num_tokens % u
    if last % s and last > saved_tokens and (group.recurrent or fine):
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

    @classmethod
    def of(cls, layout: Layout) -> Spans:
        """The spans of a validated layout (the same on every rank of the engine)."""
        dcp, u = layout.parallel.dcp_size, layout.hash_block_size
        spans = tuple(span(g, dcp) for g in layout.groups)
        fine = fine_grained(layout.groups, spans, u, dcp)
        unit = u if fine else math.lcm(*spans)
        if unit > MAX_TOKENS:
            raise InvalidLayout(
                f"hits would be aligned to {unit} tokens (the spans' least common multiple), past {MAX_TOKENS}"
            )
        return cls(layout.groups, spans, u, fine, unit)

    def load(self, hit_tokens: int, start_tokens: int = 0) -> list[range]:
        """Per group, the span indices a Load of hit_tokens writes (see load_spans)."""
        return [load_spans(g, s, hit_tokens, start_tokens) for g, s in zip(self.groups, self.spans, strict=True)]

    def save(self, num_tokens: int, saved_tokens: int = 0) -> list[list[tuple[int, int]]]:
        """Per group, the (span index, boundary) values a Save of (saved_tokens, num_tokens] stores (see save_spans)."""
        u, fine = self.hash_block_size, self.fine_grained
        pairs = zip(self.groups, self.spans, strict=True)
        return [save_spans(g, s, u, fine, num_tokens, saved_tokens) for g, s in pairs]
