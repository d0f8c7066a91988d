"""A save's written values as vLLM's BlockStored events: one event per run of consecutive blocks of a group.

A value is one group's block of `span` tokens stored under the engine's block hash at its end boundary (the hash
of hash_block_size tokens that ends there, chained over the whole prefix): that hash is the block's hash in the
event, as vLLM names a group's block whose size is a multiple of the hash block size. Partial blocks (the last
one of a fine-grained group) are stored for lookups that end inside a block; they are no block a router indexes,
so they get no event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvsidecar.events.messages import BlockStored
from kvsidecar_contract.placement import Chunk, Geometry, Kind

__all__ = ["GroupInfo", "StoredBlock", "groups_of", "stored_events"]

# vLLM's KVCacheSpecKind names for our group kinds, where they differ.
_VLLM_KIND = {Kind.MLA: "mla_attention", Kind.SLIDING_WINDOW_MLA: "sliding_window_mla"}


class GroupInfo(NamedTuple):
    """What an event says about one group: tokens per value, vLLM's kind name, sliding window (or None)."""

    span: int
    kind: str
    window: int | None


class StoredBlock(NamedTuple):
    """One value an event announced: its store key, group, block hash and medium (what the sweep watches)."""

    key: str
    group: int
    block_hash: bytes
    medium: str


def groups_of(geometry: Geometry) -> tuple[GroupInfo, ...]:
    """The event facts of each group of a session's geometry."""
    out = []
    for g in geometry.groups:
        spec = g.spec
        member = spec.members[0]  # a uniform group's members share one page layout; vLLM names it by the first
        kind = _VLLM_KIND.get(member, member.value)
        out.append(GroupInfo(g.span, kind, spec.window or None))
    return tuple(out)


def stored_events(
    groups: Sequence[GroupInfo],
    hash_block_size: int,
    hashes: Sequence[bytes],
    written: Iterable[Chunk],
    medium: str,
    tokens: Sequence[int] = (),
    tokens_start: int = 0,
) -> tuple[list[BlockStored], list[StoredBlock]]:
    """BlockStored events for the complete blocks written, and the blocks they name.

    tokens, given, are the request's tokens from position tokens_start on: a run whose tokens they cover carries
    them (span tokens per block, in order), others carry none.
    """
    u = hash_block_size
    by_group: dict[int, list[Chunk]] = {}
    for c in written:
        # A block stored as one value per KV head (rule 11) is one block to a router: its first head's value
        # stands for it (and is the key the sweep watches).
        if c.part == 0 and c.boundary % groups[c.group].span == 0:
            by_group.setdefault(c.group, []).append(c)
    events: list[BlockStored] = []
    blocks: list[StoredBlock] = []
    for g in sorted(by_group):
        info = groups[g]
        run: list[Chunk] = []
        for c in sorted(by_group[g], key=lambda c: c.span_index):
            if run and c.span_index != run[-1].span_index + 1:
                events.append(_event(g, info, u, hashes, run, medium, tokens, tokens_start))
                run = []
            run.append(c)
            blocks.append(StoredBlock(c.key, g, hashes[c.boundary // u - 1], medium))
        if run:
            events.append(_event(g, info, u, hashes, run, medium, tokens, tokens_start))
    return events, blocks


def _event(
    group: int,
    info: GroupInfo,
    u: int,
    hashes: Sequence[bytes],
    run: Sequence[Chunk],
    medium: str,
    tokens: Sequence[int],
    tokens_start: int,
) -> BlockStored:
    first = run[0].boundary - info.span  # the run's first token
    last = run[-1].boundary
    parent = hashes[first // u - 1] if first else None
    covered = tokens_start <= first and last <= tokens_start + len(tokens)
    return BlockStored(
        block_hashes=[hashes[c.boundary // u - 1] for c in run],
        parent_block_hash=parent,
        token_ids=list(tokens[first - tokens_start : last - tokens_start]) if covered else [],
        block_size=info.span,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=info.kind,
        kv_cache_spec_sliding_window=info.window,
    )
