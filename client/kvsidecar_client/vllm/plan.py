"""Which blocks a Save or Load will touch, so the connector never hands the daemon a block it must not read.

The daemon owns placement (keys, striping, quorum); the client never computes a key. What the connector must know
is narrower: which of its block ids a Save reads and a Load writes (docs/placement.md, "What gets stored" and rule 8).
Those spans come from the contract (`kvsidecar_contract.placement.Spans`), the very functions the daemon's save and
load plans are built on, so the two cannot drift. What is left here is about vLLM, whose block table is not a plain
positional array: its null block stands in for blocks a sliding window or an "align"-mode Mamba group has retired,
and a recurrent group holds only the state after the tokens computed so far, not one state per block. A Save over
such a block would store garbage under a real key: a silent wrong answer on the next hit. So every Save is checked
here first: a span whose bytes the engine does not hold is sent as NO_BLOCK (the daemon skips it), and a Save left
with nothing to store is not sent.

Pure: ints and tuples in, value types out; importable without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar_client.errors import Unsupported
from kvsidecar_client.layout import SessionSpec
from kvsidecar_client.results import SessionInfo
from kvsidecar_contract.limits import NO_BLOCK
from kvsidecar_contract.placement import Spans

__all__ = ["SaveCheck", "Spans", "check_save", "load_block_ids", "saved_chunks", "shape_of"]


class SaveCheck(NamedTuple):
    """Whether a Save over (saved_tokens, num_tokens] is worth sending, the block ids to send, and those it reads."""

    ok: bool
    reason: str
    reads: frozenset[int]
    chunks: int  # values the Save stores over all ranks (0: nothing to send)
    block_ids: tuple[tuple[int, ...], ...] = ()  # per group, NO_BLOCK where the engine holds no right bytes


def shape_of(spec: SessionSpec, info: SessionInfo | None = None) -> Spans:
    """A session's spans by the contract's rules, checked against the daemon's OpenSession answer when given.

    The connector and the daemon derive them from the same code; a daemon that answers otherwise runs other rules
    (version skew), and planning loads and saves by rules the daemon does not follow would corrupt the fence.
    """
    spans = Spans.of(spec.to_placement())
    if info is not None:
        theirs = (tuple(g.span_tokens for g in info.groups), info.fine_grained_hits, info.hit_alignment_tokens)
        ours = (spans.spans, spans.fine_grained, spans.unit)
        if theirs != ours:
            raise Unsupported(
                f"the daemon {info.daemon_version} places this session with (spans, fine-grained hits, hit "
                f"alignment) {theirs}, this client's contract with {ours}: install matching versions"
            )
    return spans


def saved_chunks(shape: Spans, num_tokens: int, saved_tokens: int) -> list[list[tuple[int, int]]]:
    """Per group, the (block index, boundary) of every value a Save of (saved_tokens, num_tokens] stores."""
    return shape.save(num_tokens, saved_tokens)


def check_save(
    shape: Spans,
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
    for g, (group, items) in enumerate(zip(shape.groups, shape.save(num_tokens, saved_tokens), strict=True)):
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
    shape: Spans, block_ids: Sequence[Sequence[int]], hit_tokens: int, start_tokens: int
) -> list[list[int]]:
    """Per group, the block ids a Load of hit_tokens (engine already holding start_tokens) writes into.

    Spans past the end of a group's table have no block id: the daemon refuses such a load, and nothing is written.
    """
    loads = shape.load(hit_tokens, start_tokens)
    return [[ids[i] for i in spans if i < len(ids)] for spans, ids in zip(loads, block_ids, strict=True)]
