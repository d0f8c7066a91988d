"""Which blocks a Save or Load will touch, so the connector never hands the daemon a block it must not read.

The daemon owns placement (keys, striping, quorum); the client never computes a key. What the connector must know
is narrower: which of its block ids a Save reads and a Load writes (PLACEMENT.md, "What gets stored" and rule 8),
because vLLM's block table is not a plain positional array. Its null block stands in for blocks a sliding window
or an "align"-mode Mamba group has retired, and a recurrent group holds only the state after the tokens computed
so far, not one state per block. A Save over such a block would store garbage under a real key: a silent wrong
answer on the next hit. So every Save is checked here first: a span whose bytes the engine does not hold is sent as
NO_BLOCK (the daemon skips it), and a Save left with nothing to store is not sent.

Pure: ints and tuples in, value types out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar_client.layout import GroupSpec
from kvsidecar_client.results import SessionInfo
from kvsidecar_contract.limits import NO_BLOCK

__all__ = ["GroupShape", "SaveCheck", "Shape", "load_block_ids", "check_save", "saved_chunks", "shape_of"]

_RECURRENT = frozenset({"mamba"})
_SLIDING = frozenset({"sliding_window", "sliding_window_mla"})


class GroupShape(NamedTuple):
    """One session group as the daemon places it: tokens per block, recurrent or not, sliding window (0: none)."""

    span: int
    recurrent: bool
    window: int


class Shape(NamedTuple):
    """The session's groups, hash block size U, and whether hits may end inside a block."""

    groups: tuple[GroupShape, ...]
    unit: int
    fine_grained: bool


class SaveCheck(NamedTuple):
    """Whether a Save over (saved_tokens, num_tokens] is worth sending, the block ids to send, and those it reads."""

    ok: bool
    reason: str
    reads: frozenset[int]
    chunks: int  # values the Save stores over all ranks (0: nothing to send)
    block_ids: tuple[tuple[int, ...], ...] = ()  # per group, NO_BLOCK where the engine holds no right bytes


def shape_of(groups: Sequence[GroupSpec], info: SessionInfo, hash_block_size: int) -> Shape:
    """The shape of a session, from its groups and the daemon's OpenSession answer (spans, fine-grained hits)."""
    shapes = []
    for spec, placement in zip(groups, info.groups, strict=True):
        members = spec.members
        window = spec.window if all(kind in _SLIDING for kind in members) else 0
        shapes.append(GroupShape(placement.span_tokens, any(k in _RECURRENT for k in members), window))
    return Shape(tuple(shapes), hash_block_size, info.fine_grained_hits)


def saved_chunks(shape: Shape, num_tokens: int, saved_tokens: int) -> list[list[tuple[int, int]]]:
    """Per group, the (block index, boundary) of every value a Save of (saved_tokens, num_tokens] stores.

    Attention kinds store each complete block under its end, and with fine-grained hits the partial last block
    under the last U boundary; recurrent kinds store the state at each block end and at the last U boundary.
    """
    u = shape.unit
    last = num_tokens - num_tokens % u
    out = []
    for group in shape.groups:
        s = group.span
        chunks = [(k, (k + 1) * s) for k in range(num_tokens // s)]
        if last % s and (group.recurrent or shape.fine_grained):
            chunks.append((last // s, last))
        out.append([(k, b) for k, b in chunks if b > saved_tokens])
    return out


def check_save(
    shape: Shape,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    saved_tokens: int,
    null_block: int,
) -> SaveCheck:
    """The block ids a Save sends (NO_BLOCK where the engine does not hold a value's bytes) and those it reads.

    A recurrent group holds one state: the one after `num_tokens` tokens, in the block covering the last of them.
    So a recurrent value is sent only for the boundary num_tokens; every other span, and every span whose block is
    vLLM's null block or past the table, is sent as NO_BLOCK, which the daemon skips.
    """
    reads: set[int] = set()
    chunks = 0
    skipped: list[str] = []
    out = [list(ids) for ids in block_ids]
    for g, (group, items) in enumerate(zip(shape.groups, saved_chunks(shape, num_tokens, saved_tokens), strict=True)):
        ids = out[g]
        for index, boundary in items:
            if index >= len(ids):
                ids.extend([NO_BLOCK] * (index + 1 - len(ids)))
            if group.recurrent and boundary != num_tokens:
                skipped.append(f"group {g} holds the state after {num_tokens} tokens, not the state after {boundary}")
                ids[index] = NO_BLOCK
            elif ids[index] in (null_block, NO_BLOCK):
                skipped.append(f"group {g} has no block for its span {index}")
                ids[index] = NO_BLOCK
            else:
                reads.add(ids[index])
                chunks += 1
    if not chunks:
        return SaveCheck(False, "; ".join(skipped) or "nothing new to store", frozenset(), 0)
    return SaveCheck(True, "; ".join(skipped), frozenset(reads), chunks, tuple(tuple(ids) for ids in out))


def load_block_ids(
    shape: Shape, block_ids: Sequence[Sequence[int]], hit_tokens: int, start_tokens: int
) -> list[list[int]]:
    """Per group, the block ids a Load of hit_tokens (engine already holding start_tokens) writes into."""
    out: list[list[int]] = []
    for group, ids in zip(shape.groups, block_ids, strict=True):
        if hit_tokens <= start_tokens:
            out.append([])
            continue
        s = group.span
        last = (hit_tokens - 1) // s
        if group.recurrent:
            first = last
        else:
            # vLLM's sliding window needs the W - 1 tokens before the next one (the contract's first_needed_block).
            first = max(0, (hit_tokens - group.window + 1) // s) if group.window else 0
        first = max(first, start_tokens // s)
        out.append([ids[i] for i in range(first, min(last + 1, len(ids)))])
    return out
