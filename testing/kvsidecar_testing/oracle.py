"""The byte oracle: what an engine rank's KV blocks hold, and what a load must bring back.

Written from the engine's point of view, never from the placement rules, so the daemon can be checked against it:

- What a rank holds for a group (`group_bytes`) depends on which heads, which latent, which state shard, which
  sequence slice and which pipeline stage it owns. Ranks of one replication set hold the same bytes; any other rank,
  group, engine or tenant holds different ones.
- A block of an attention group spans S tokens (block_size, times D under DCP: a rank holds every D-th token); a
  recurrent block holds the state at one boundary, at block_size granularity (`GroupView`).
- A load of a hit of L tokens must fill, per group, the blocks the engine needs to resume at L (`needed_blocks`):
  every block before L for full attention, the blocks of the W - 1 tokens before L for a sliding window of W (as
  vLLM's sliding window counts them), the block holding the state at L for recurrent state.

Two renderings of the same model: whole blocks named by a tag (`pattern`, `cold_block_tags`, `warm_block_tags`:
end-to-end tests and the demo compare digests of whole blocks), and U-token sub-slices filled from a holder's
identity and the prefix hash (`computed_block`, `expected_loaded`: the fuzz and soak check partial tails byte for
byte).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvsidecar_contract.placement import GroupSpec, Kind, Layout
from kvsidecar_testing.hashes import chained_hashes

if TYPE_CHECKING:
    from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = [
    "GARBAGE",
    "POISON",
    "GroupView",
    "Prompt",
    "RankId",
    "blocks_of",
    "cold_block_tags",
    "computed_block",
    "digest",
    "expected_digests",
    "expected_loaded",
    "fill",
    "group_bytes",
    "holder",
    "identity",
    "layout_of",
    "member_bytes",
    "needed_blocks",
    "pattern",
    "views",
    "warm_block_tags",
]

POISON = 0xA5  # what a cleared (freshly allocated) block holds before a load
GARBAGE = 0xEE  # what a block holds past the tokens the engine computed


# ---- who holds what --------------------------------------------------------------------------------------------------


def dcp_slice(tp_rank: int, pcp_rank: int, tp_size: int, pcp_size: int, dcp_size: int) -> int | None:
    """Which slice of the sequence a rank holds under DCP (None: all of it).

    vLLM numbers ranks PP x PCP x TP and cuts DCP groups out of the (TP, PCP) plane with PCP varying fastest; the
    slot mapping then stores token i on the group member of rank (i // interleave) mod D.
    """
    if dcp_size == 1:
        return None
    plane = [(t, c) for t in range(tp_size) for c in range(pcp_size)]  # PCP fastest
    return plane.index((tp_rank, pcp_rank)) % dcp_size


def member_bytes(
    kind: Kind, tp_rank: int, tp_size: int, num_kv_heads: int, dcp_size: int, pcp_rank: int = 0, pcp_size: int = 1
) -> Hashable:
    """What one member kind of a group holds on a TP rank."""
    seq = dcp_slice(tp_rank, pcp_rank, tp_size, pcp_size, dcp_size)  # DCP: each rank holds its slice
    if kind is Kind.MAMBA:
        return ("state-shard", tp_rank)  # head/dim-sharded state: never the same on two ranks
    if kind in (Kind.MLA, Kind.SLIDING_WINDOW_MLA):
        return ("latent", seq)  # the latent is replicated on every rank
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        heads = tuple(range(tp_rank * per, (tp_rank + 1) * per))
    else:
        heads = (tp_rank * num_kv_heads // tp_size,)  # T/H ranks replicate each KV head
    return ("heads", heads, seq)


def group_bytes(layout: Layout, group: GroupSpec, tp_rank: int, pcp_rank: int, pp_rank: int) -> Hashable:
    """What a rank holds for a whole group: every member, on its own PCP rank and pipeline stage."""
    par = layout.parallel
    members = tuple(
        member_bytes(k, tp_rank, par.tp_size, layout.num_kv_heads, par.dcp_size, pcp_rank, par.pcp_size)
        for k in group.members
    )
    # PCP ranks stay apart even where they hold the same prompt KV (D = 1): decode then runs on one PCP owner only,
    # so the blocks it writes are on that rank alone.
    return (members, pcp_rank, pp_rank)


class RankId(NamedTuple):
    """Which engine rank: TP, PCP and PP rank."""

    tp: int
    pcp: int = 0
    pp: int = 0


def holder(layout: Layout, group: int, rank: RankId) -> str:
    """A stable name for what this rank holds in this group; equal names mean byte-identical content."""
    return repr(group_bytes(layout, layout.groups[group], rank.tp, rank.pcp, rank.pp))


def identity(engine: str, layout: Layout, group: int, tp: int, pcp: int, pp: int) -> bytes:
    """A digest of what rank (tp, pcp, pp) of `engine` holds for `group` (equal within a replication set)."""
    held = group_bytes(layout, layout.groups[group], tp, pcp, pp)
    return hashlib.sha256(f"{engine}/{group}/{held!r}".encode()).digest()


# ---- which blocks ----------------------------------------------------------------------------------------------------


class GroupView(NamedTuple):
    """One group as the engine sees it: tokens a block spans, state or token blocks, and the attention window."""

    span: int
    recurrent: bool  # any recurrent member: the block is valid at exactly its boundary
    attention: bool  # any member storing token blocks
    window: int | None  # tokens of history attention needs (None: all)

    @classmethod
    def of(cls, members: Sequence[Kind], block_size: int, window: int, dcp_size: int) -> GroupView:
        """The view of a group of these member kinds."""
        recurrent = Kind.MAMBA in members
        attn = [k for k in members if k is not Kind.MAMBA]
        sliding = bool(attn) and all(k in (Kind.SLIDING_WINDOW, Kind.SLIDING_WINDOW_MLA) for k in attn)
        return cls(
            block_size if recurrent else block_size * dcp_size, recurrent, bool(attn), window if sliding else None
        )


def view_of(group: GroupSpec, dcp_size: int) -> GroupView:
    """The engine's view of one group of a layout."""
    return GroupView.of(group.members, group.block_size, group.window, dcp_size)


def layout_of(req: pb.OpenSessionRequest) -> Layout:
    """The engine layout a (valid) OpenSession request describes, parsed exactly as the daemon parses it."""
    from kvsidecar.rpc import wire

    return wire.open_request(req)[1]


def views(req: pb.OpenSessionRequest) -> list[GroupView]:
    """Per group of an OpenSession request: its view (read from the request, not from the placement core)."""
    from kvsidecar_contract.kinds import KIND_OF_PROTO
    from kvsidecar_contract.proto import sidecar_pb2 as pb

    dcp = req.parallel.dcp_size or 1
    out = []
    for g in req.groups:
        members = [KIND_OF_PROTO[k] for k in (g.inner if g.kind == pb.UNIFORM else [g.kind])]
        out.append(GroupView.of(members, g.block_size, g.window, dcp))
    return out


def needed_blocks(view: GroupView, hit: int, start: int = 0) -> range:
    """Block indices the engine needs filled to resume at `hit` tokens, past the `start` tokens it already holds."""
    if hit <= start:
        return range(0)
    last = (hit - 1) // view.span
    if not view.attention:
        return range(last, last + 1)
    # The next token attends to the last W - 1 tokens before it (vLLM's sliding window), at least one.
    first = 0 if view.window is None else max(0, hit - max(view.window, 2) + 1) // view.span
    return range(max(first, start // view.span), last + 1)


def blocks_of(group: GroupSpec, dcp_size: int, num_tokens: int) -> int:
    """Physical blocks the engine allocates to hold num_tokens tokens of this group."""
    return -(-num_tokens // view_of(group, dcp_size).span)


# ---- whole blocks named by a tag -------------------------------------------------------------------------------------


def pattern(tag: str, nbytes: int) -> bytes:
    """The bytes of a block named by tag: pseudo-random, so a block from any other tag or offset differs."""
    return hashlib.shake_256(tag.encode()).digest(nbytes)


def digest(data: bytes) -> str:
    """The short fingerprint rank processes report per block."""
    return hashlib.sha256(data).hexdigest()[:24]


class Prompt(NamedTuple):
    """A prompt as the engine sees it: its length and its chained block hashes (one per U tokens).

    Prompts with the same salt share their token prefix: hash i is the same for every length that reaches it.
    """

    salt: str
    num_tokens: int
    hash_block_size: int

    @property
    def hashes(self) -> list[bytes]:
        """One chained hash per complete U tokens."""
        return chained_hashes(self.salt, self.num_tokens // self.hash_block_size)

    @property
    def complete(self) -> int:
        """Tokens in complete U units: the longest prefix a block hash names."""
        return self.num_tokens - self.num_tokens % self.hash_block_size


def _tag(layout: Layout, group: int, tensor: int, rank: RankId, what: str, prompt: Prompt, end: int) -> str:
    # `end` names the prefix: the block's tokens (or the state) depend on every token before it.
    prefix = prompt.hashes[end // prompt.hash_block_size - 1].hex()
    return f"{layout.model_key}|g{group}|t{tensor}|{holder(layout, group, rank)}|{what}|{end}|{prefix}"


def cold_block_tags(layout: Layout, group: int, tensor: int, rank: RankId, prompt: Prompt) -> dict[int, str]:
    """After prefilling `prompt`: block index -> tag of what it holds (only blocks with a complete unit).

    Attention block k holds tokens [k*S, min((k+1)*S, end)) where end is the last complete U unit; a recurrent block
    k holds the state after min((k+1)*S, end) tokens.
    """
    view = view_of(layout.groups[group], layout.parallel.dcp_size)
    end = prompt.complete
    what = "state" if view.recurrent else "kv"
    return {
        k: _tag(layout, group, tensor, rank, what, prompt, min((k + 1) * view.span, end))
        for k in range(-(-end // view.span))
    }


def warm_block_tags(
    layout: Layout, group: int, tensor: int, rank: RankId, cold: Prompt, hit_tokens: int, start_tokens: int = 0
) -> dict[int, str]:
    """After loading a hit of hit_tokens of a prompt prefilled as `cold`: block index -> tag it must hold.

    The needed blocks as the cold prefill left them, except the block holding the hit end of a recurrent group,
    which holds the state after exactly hit_tokens tokens. Every other block stays as it was.
    """
    view = view_of(layout.groups[group], layout.parallel.dcp_size)
    needed = needed_blocks(view, hit_tokens, start_tokens)
    if not needed:
        return {}
    cold_tags = cold_block_tags(layout, group, tensor, rank, cold)
    out = {k: cold_tags[k] for k in needed}
    if view.recurrent:
        out[needed[-1]] = _tag(layout, group, tensor, rank, "state", cold, hit_tokens)
    return out


def expected_digests(
    tags_by_block: dict[int, str], block_ids: Sequence[int], num_blocks: int, block_bytes: int
) -> list[str]:
    """Digest of every block of one tensor: the tagged pattern where block_ids[k] is tagged k, else poison."""
    out = [digest(bytes([POISON]) * block_bytes)] * num_blocks
    for k, tag in tags_by_block.items():
        out[block_ids[k]] = digest(pattern(tag, block_bytes))
    return out


# ---- U-token sub-slices filled from an identity ----------------------------------------------------------------------


def fill(ident: bytes, key: bytes, n: int) -> bytes:
    """n bytes determined by a holder's identity and a prefix hash."""
    seed = hashlib.sha256(ident + key).digest()
    return (seed * (n // len(seed) + 1))[:n]


def computed_block(
    ident: bytes, view: GroupView, u: int, hashes: Sequence[bytes], index: int, tokens: int, n: int
) -> bytes:
    """Block `index` of a group after the engine computed `tokens` tokens of the prompt (n bytes)."""
    last = min(tokens - tokens % u, len(hashes) * u)
    if view.recurrent:
        boundary = min((index + 1) * view.span, last)
        return fill(ident, hashes[boundary // u - 1], n) if boundary > 0 else bytes([GARBAGE]) * n
    return b"".join(
        fill(ident, hashes[end // u - 1], size) if end <= last else bytes([GARBAGE]) * size
        for end, size in _sub_slices(view, u, index, n)
    )


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
