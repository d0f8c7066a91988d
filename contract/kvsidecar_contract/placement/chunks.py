"""Save and load plans (rules 4, 5, 8, 10): which values a rank writes or reads, under which keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar_contract.limits import NO_BLOCK
from kvsidecar_contract.placement.errors import RequestMismatch
from kvsidecar_contract.placement.geometry import Geometry, GroupGeometry
from kvsidecar_contract.placement.keys import block_key
from kvsidecar_contract.placement.spans import load_spans, save_spans


class Chunk(NamedTuple):
    """One value moved between a physical block and the store."""

    group: int
    span_index: int  # absolute block index in the group: the block covering its span_index-th span
    boundary: int  # token boundary the value is stored under; its key uses hash boundary // U - 1
    block_id: int
    key: str
    part: int = 0  # which of the block's `parts` values it is (head-major parts, rule 11; state pieces, rule 12)
    parts: int = 1  # 1: the value is the whole block


class SavePlan(NamedTuple):
    """What one rank writes for one save request."""

    chunks: tuple[Chunk, ...]
    others: int  # values of this save that another rank of the replication set writes
    absent: int = 0  # chunks this rank would write but holds no block for (NO_BLOCK)


def save_plan(
    geo: Geometry,
    block_hashes: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    saved_tokens: int = 0,
) -> SavePlan:
    """The chunks this rank writes: striped in each replication set, skipping boundaries <= saved_tokens."""
    u = geo.layout.hash_block_size
    _check_groups(geo, block_ids)
    if not 0 <= saved_tokens <= num_tokens:
        raise RequestMismatch(f"saved_tokens {saved_tokens} must be in [0, num_tokens={num_tokens}]")
    if len(block_hashes) < num_tokens // u:
        raise RequestMismatch(
            f"{num_tokens} tokens need {num_tokens // u} block hashes (one per {u} tokens), got {len(block_hashes)}"
        )
    chunks: list[Chunk] = []
    others = absent = 0
    for group in geo.groups:
        ids = block_ids[group.index]
        for index, boundary in save_spans(group.spec, group.span, u, group.fine, num_tokens, saved_tokens):
            mine = group.writing(index)
            others += len(group.own) - len(mine)
            if not mine:
                continue
            _check_index(group, ids, index)
            if ids[index] == NO_BLOCK:
                absent += 1
                continue
            values = _values(group, index, boundary, ids[index], block_hashes[boundary // u - 1])
            chunks += values if len(mine) == len(values) else [values[p] for p in mine]
    return SavePlan(tuple(chunks), others, absent)


def load_plan(
    geo: Geometry,
    block_hashes: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    hit_tokens: int,
    tails: Sequence[int],
    start_tokens: int = 0,
    carried: Sequence[int] = (),
) -> tuple[Chunk, ...]:
    """The chunks this rank reads to serve hit_tokens, every one from its own namespace (never striped).

    Blocks that end at or before start_tokens are already in the engine and are not read. The block that
    contains the hit end is read under its tail boundary, exactly as the lookup reported it. A chunk whose block
    id is NO_BLOCK stays in the plan: the engine has nowhere to put it, so the load must report it failed.
    carried names the groups the load is for (empty: every group): the others' block ids are not looked at.
    """
    u = geo.layout.hash_block_size
    _check_groups(geo, block_ids)
    check_hit(geo, len(block_hashes), hit_tokens, tails)
    if not 0 <= start_tokens <= hit_tokens:
        raise RequestMismatch(f"start_tokens {start_tokens} must be in [0, hit_tokens={hit_tokens}]")
    wanted = _carried(geo, carried)
    chunks: list[Chunk] = []
    for group, tail in zip(geo.groups, tails, strict=True):
        if group.index not in wanted:
            continue
        ids = block_ids[group.index]
        spans = load_spans(group.spec, group.span, hit_tokens, start_tokens)
        for index in spans:
            _check_index(group, ids, index)
            boundary = (index + 1) * group.span if index < spans.stop - 1 else tail
            chunks += _values(group, index, boundary, ids[index], block_hashes[boundary // u - 1])
    return tuple(chunks)


def _values(group: GroupGeometry, index: int, boundary: int, block_id: int, block_hash: bytes) -> list[Chunk]:
    """The values of one block: one, or one per group of KV heads (rule 11) or state piece (rule 12) it holds."""
    own = group.own
    return [
        Chunk(group.index, index, boundary, block_id, block_key(prefix, block_hash), part, len(own))
        for part, prefix in enumerate(own)
    ]


def check_hit(geo: Geometry, num_hashes: int, hit_tokens: int, tails: Sequence[int]) -> None:
    """Reject a hit length or tail boundary that no lookup could have produced (rules 8-10)."""
    u = geo.layout.hash_block_size
    if len(tails) != len(geo.groups):
        raise RequestMismatch(f"expected {len(geo.groups)} tail boundaries (one per group), got {len(tails)}")
    if hit_tokens < 0 or hit_tokens % geo.unit:
        raise RequestMismatch(f"hit_tokens {hit_tokens} is not a non-negative multiple of {geo.unit}")
    if hit_tokens > num_hashes * u:
        raise RequestMismatch(f"hit_tokens {hit_tokens} exceeds the {num_hashes} block hashes given")
    for group, tail in zip(geo.groups, tails, strict=True):
        where = f"group {group.index} ({group.spec.describe()})"
        if hit_tokens == 0:
            if tail:
                raise RequestMismatch(f"{where}: tail boundary must be 0 for a zero-token hit, got {tail}")
            continue
        block_end = ((hit_tokens - 1) // group.span + 1) * group.span
        exact = group.spec.recurrent or hit_tokens == block_end
        if exact and tail != hit_tokens:
            raise RequestMismatch(f"{where}: tail boundary must be the hit end {hit_tokens}, got {tail}")
        if not hit_tokens <= tail <= block_end or tail % u or tail > num_hashes * u:
            raise RequestMismatch(
                f"{where}: tail boundary {tail} must be a multiple of {u} in [{hit_tokens}, {block_end}] "
                f"covered by the block hashes given"
            )


def _check_groups(geo: Geometry, block_ids: Sequence[Sequence[int]]) -> None:
    if len(block_ids) != len(geo.groups):
        raise RequestMismatch(f"expected block ids for {len(geo.groups)} groups, got {len(block_ids)}")


def _carried(geo: Geometry, carried: Sequence[int]) -> range | set[int]:
    """The groups a load carries: those named (each once, each a group of the layout), or every group."""
    if not carried:
        return range(len(geo.groups))
    wanted = set(carried)
    if len(wanted) != len(carried) or not wanted <= set(range(len(geo.groups))):
        raise RequestMismatch(
            f"carried groups {list(carried)} must name each of the {len(geo.groups)} groups at most once"
        )
    return wanted


def _check_index(group: GroupGeometry, ids: Sequence[int], index: int) -> None:
    if index >= len(ids):
        raise RequestMismatch(
            f"group {group.index} ({group.spec.describe()}) needs a block id for span {index}, got {len(ids)} block ids"
        )
