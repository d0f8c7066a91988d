"""Lookups (rules 7-10): the keys to probe, the quorum per boundary, and the hit length with its tails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar.placement.errors import InvalidRequest
from kvsidecar.placement.geometry import Geometry, GroupGeometry
from kvsidecar.placement.keys import hash_suffixes


class Segment(NamedTuple):
    """A run of probe keys: one group's probed hash indices, repeated for each of its namespaces."""

    group: int
    hashes: range  # hash indices probed, in key order
    namespaces: int


class LookupPlan(NamedTuple):
    """Every key one lookup probes, in one flat list for a single batch existence check."""

    keys: list[str]
    segments: tuple[Segment, ...]
    num_hashes: int

    def stored(self, present: Sequence[bool]) -> list[list[bool]]:
        """Per group, per hash index: whether that boundary exists in every namespace (rule 7)."""
        if len(present) != len(self.keys):
            raise InvalidRequest(f"expected {len(self.keys)} probe results, got {len(present)}")
        out: list[list[bool]] = []
        pos = 0
        for seg in self.segments:
            m = len(seg.hashes)
            quorum = list(present[pos : pos + m])
            for ns in range(1, seg.namespaces):
                start = pos + ns * m
                quorum = [a and b for a, b in zip(quorum, present[start : start + m], strict=True)]
            pos += m * seg.namespaces
            row = [False] * self.num_hashes
            for i, ok in zip(seg.hashes, quorum, strict=True):
                row[i] = bool(ok)
            out.append(row)
        return out


class Hit(NamedTuple):
    """A lookup answer: tokens every group can serve, and per group the boundary of its last block's key."""

    tokens: int
    tails: tuple[int, ...]


def lookup_plan(geo: Geometry, block_hashes: Sequence[bytes], num_tokens: int) -> LookupPlan:
    """The probe keys for a prompt of num_tokens tokens with its chained block hashes."""
    n = _check_prompt(geo, len(block_hashes), num_tokens)
    suffixes = hash_suffixes(list(block_hashes[:n]))
    keys: list[str] = []
    segments = []
    for group in geo.groups:
        probed = geo.probed_boundaries(group, n)
        sub = suffixes if probed.step == 1 else suffixes[probed.start :: probed.step]
        for prefix in group.lookup_prefixes:
            keys += map(prefix.__add__, sub)
        segments.append(Segment(group.index, probed, group.keys_per_boundary))
    return LookupPlan(keys, tuple(segments), n)


def compute_hit(geo: Geometry, num_tokens: int, stored: Sequence[Sequence[bool]], *, eagle: bool = False) -> Hit:
    """Rule 9's fixed point over every group, then rule 10's tail boundaries.

    stored[g][i] says whether the boundary (i + 1) * U of group g exists in every namespace.
    """
    if len(stored) != len(geo.groups):
        raise InvalidRequest(f"expected stored flags for {len(geo.groups)} groups, got {len(stored)}")
    n = len(stored[0]) if stored else 0
    if any(len(row) != n for row in stored):
        raise InvalidRequest("stored flags must cover the same number of boundaries for every group")
    _check_prompt(geo, n, num_tokens)
    u, unit = geo.layout.hash_block_size, geo.unit
    # The last prompt token is always recomputed, so at most num_tokens - 1 tokens can come from the store.
    cap = max(0, min(num_tokens - 1, n * u))
    cap -= cap % unit
    servers = [_Server(g, row, u) for g, row in zip(geo.groups, stored, strict=True)]
    hit = cap
    if eagle:
        attention = [s for s in servers if not s.group.spec.recurrent]
        if attention:
            # EAGLE drafts from the last hit position: attention gives back one unit, recurrent groups do not.
            hit = max(0, _fixed_point(attention, hit, unit) - unit)
    hit = _fixed_point(servers, hit, unit)
    tails = tuple(s.tail(hit) for s in servers)
    return Hit(hit, tuple(t if t is not None else 0 for t in tails))


def _fixed_point(servers: Sequence[_Server], hit: int, unit: int) -> int:
    while True:
        before = hit
        for server in servers:
            hit = server.largest(hit, unit)
        if hit == before:
            return hit


class _Server:
    """Answers rule 8 for one group in O(1) per length, from its stored boundaries."""

    def __init__(self, group: GroupGeometry, stored: Sequence[bool], u: int) -> None:
        self.group, self.stored, self.u = group, stored, u
        n = len(stored)
        per_block = group.span // u
        # missing[k]: how many of blocks 0..k-1 are not stored whole under their end boundary.
        self.missing = [0]
        for k in range(n // per_block):
            self.missing.append(self.missing[-1] + (not stored[(k + 1) * per_block - 1]))
        # next_stored[i]: the first stored hash index >= i (n if none), to find a tail inside a block.
        self.next_stored = [n] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.next_stored[i] = i if stored[i] else self.next_stored[i + 1]

    def largest(self, hit: int, unit: int) -> int:
        """The largest length <= hit this group can serve (0 always can)."""
        while hit and self.tail(hit) is None:
            hit -= unit
        return hit

    def tail(self, hit: int) -> int | None:
        """The boundary the block containing the hit end is read under, or None if hit is not servable."""
        if hit == 0:
            return 0
        spec, s, u = self.group.spec, self.group.span, self.u
        i = hit // u - 1
        last = (hit - 1) // s
        at_end = hit % s == 0
        if not spec.attention:
            return hit if self.stored[i] else None
        window = spec.attention_window
        first = 0 if window is None else max(0, (hit - window) // s)
        whole_end = last + 1 if at_end else last  # blocks [first, whole_end) must be stored whole
        if whole_end >= len(self.missing) or self.missing[whole_end] - self.missing[min(first, whole_end)]:
            return None
        if at_end:
            return hit
        if spec.recurrent:  # a packed value with state in it is only valid at exactly its boundary
            return hit if self.stored[i] else None
        j = self.next_stored[i]
        tail = (j + 1) * u
        return tail if j < len(self.stored) and tail <= (last + 1) * s else None


def _check_prompt(geo: Geometry, num_hashes: int, num_tokens: int) -> int:
    u = geo.layout.hash_block_size
    if num_tokens < 0:
        raise InvalidRequest(f"num_tokens must be >= 0, got {num_tokens}")
    if num_hashes > num_tokens // u:
        raise InvalidRequest(
            f"{num_hashes} block hashes cover {num_hashes * u} tokens, more than num_tokens={num_tokens}"
        )
    return num_hashes
