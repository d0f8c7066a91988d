"""What an engine rank's KV blocks hold, and what a load must bring back: the byte-level oracle of the fuzz and soak.

Written from the engine's point of view, not from the placement rules:

- A rank's bytes for a group depend on what it holds (`support.oracle.group_bytes`: which heads, which latent,
  which state shard, which sequence slice, which pipeline stage) and on the tokens. Ranks of one replication set
  hold the same bytes; any other rank, group, engine or tenant holds different ones.
- An attention block of span S is S/U sub-slices; sub-slice j of block i holds the KV of the U tokens ending at
  boundary i*S + (j+1)*U, so it is a function of the chained hash of that prefix. Sub-slices past the computed,
  U-aligned prompt hold garbage.
- A recurrent block holds the state at one boundary: a function of that boundary's hash alone.
- A load of hit length L must fill, per group, the blocks the engine needs for L (rule 8 seen from the engine:
  every block before L for full attention, the window's blocks for sliding window, the block holding the state at
  L for recurrent state), each with the bytes for the current prompt up to its end or, for the block holding L,
  up to L at least.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from kvsidecar import wire
from kvsidecar_contract.placement import Layout
from kvsidecar_contract.proto import sidecar_pb2 as pb
from support.oracle import group_bytes

GARBAGE = 0xEE
POISON = 0x5A


class GroupView(NamedTuple):
    """One group as the engine sees it: span of a block, state or token blocks, and the attention window."""

    span: int
    recurrent: bool  # any recurrent member: the block is valid at exactly its boundary
    attention: bool  # any member storing token blocks
    window: int | None  # tokens of history attention needs (None: all)


def layout_of(req: pb.OpenSessionRequest) -> Layout:
    """The engine layout a (valid) OpenSession request describes, parsed exactly as the daemon parses it."""
    return wire.open_request(req)[1]


def views(req: pb.OpenSessionRequest) -> list[GroupView]:
    """Per group: span (block_size, times D for attention kinds under DCP), recurrence and window."""
    dcp = req.parallel.dcp_size or 1
    out = []
    for g in req.groups:
        members = list(g.inner) if g.kind == pb.UNIFORM else [g.kind]
        recurrent = pb.MAMBA in members
        attention = any(k != pb.MAMBA for k in members)
        sliding = [k in (pb.SLIDING_WINDOW, pb.SLIDING_WINDOW_MLA) for k in members if k != pb.MAMBA]
        window = g.window if sliding and all(sliding) else None
        out.append(GroupView(g.block_size if recurrent else g.block_size * dcp, recurrent, attention, window))
    return out


def identity(engine: str, layout: Layout, group: int, tp: int, pcp: int, pp: int) -> bytes:
    """A digest of what rank (tp, pcp, pp) of `engine` holds for `group` (equal within a replication set)."""
    held: Hashable = group_bytes(layout, layout.groups[group], tp, pcp, pp)
    return hashlib.sha256(f"{engine}/{group}/{held!r}".encode()).digest()


def fill(ident: bytes, key: bytes, n: int) -> bytes:
    """n bytes determined by a holder's identity and a prefix hash."""
    seed = hashlib.sha256(ident + key).digest()
    return (seed * (n // len(seed) + 1))[:n]


def computed_block(ident: bytes, view: GroupView, u: int, hashes: Sequence[bytes], index: int, tokens: int, n: int):
    """Block `index` of a group after the engine computed `tokens` tokens of the prompt (n bytes)."""
    last = min(tokens - tokens % u, len(hashes) * u)
    if view.recurrent:
        boundary = min((index + 1) * view.span, last)
        return fill(ident, hashes[boundary // u - 1], n) if boundary > 0 else bytes([GARBAGE]) * n
    return b"".join(
        fill(ident, hashes[end // u - 1], size) if end <= last else bytes([GARBAGE]) * size
        for end, size in _sub_slices(view, u, index, n)
    )


def needed_blocks(view: GroupView, hit: int) -> range:
    """The block indices the engine needs filled to resume at `hit` tokens (rule 8, from the engine's side)."""
    if hit == 0:
        return range(0)
    last = (hit - 1) // view.span
    if not view.attention:
        return range(last, last + 1)
    # The next token attends to the last W - 1 tokens before it (vLLM's sliding window).
    first = 0 if view.window is None else max(0, (hit - view.window + 1) // view.span)
    return range(first, last + 1)


def expected_loaded(
    ident: bytes, view: GroupView, u: int, hashes: Sequence[bytes], index: int, hit: int, tail: int, n: int
) -> list[tuple[int, bytes]]:
    """(offset, bytes) pieces a loaded block must hold exactly: everything valid up to its end, or up to `tail`."""
    end = (index + 1) * view.span
    if view.recurrent:
        boundary = end if end <= hit else tail
        return [(0, fill(ident, hashes[boundary // u - 1], n))]
    upto = end if end <= hit else tail
    out, offset = [], 0
    for sub_end, size in _sub_slices(view, u, index, n):
        if sub_end <= upto:
            out.append((offset, fill(ident, hashes[sub_end // u - 1], size)))
        offset += size
    return out


def _sub_slices(view: GroupView, u: int, index: int, n: int) -> list[tuple[int, int]]:
    """(token end, bytes) of each U-token sub-slice of an attention block of n bytes (the last takes the rest)."""
    parts = view.span // u
    size = n // parts
    sizes = [size] * (parts - 1) + [n - size * (parts - 1)]
    return [(index * view.span + (j + 1) * u, sizes[j]) for j in range(parts)]
