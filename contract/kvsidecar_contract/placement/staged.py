"""Staged lookups: probe only the keys that can still change the answer, and give exactly probe-everything's answer.

Stage 1 probes the group with the fewest keys per boundary; a full-attention group is probed in growing prefixes
and stops at its first missing block, since no longer length is servable past it. That gives a bound B >= the hit.
Stage 2 probes every group only up to B (rounded up to its block end): the servability and tail of every length
<= B depend on nothing above that, so treating the unprobed keys as absent gives the exact answer. EAGLE's answer
also depends on how far attention alone reaches, so there the answer is checked: unprobed keys taken as present
and as absent must agree (the hit is monotone in the stored set), else every remaining key is probed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar_contract.placement.errors import RequestMismatch
from kvsidecar_contract.placement.geometry import Geometry, GroupGeometry
from kvsidecar_contract.placement.keys import hash_suffixes
from kvsidecar_contract.placement.lookup import Hit, check_probe_count, compute_hit

__all__ = ["FIRST_CHUNK", "StagedLookup"]

FIRST_CHUNK = 64  # boundaries of the cheapest group in stage 1's first call: a miss costs one tiny batch
_GROWTH = 4  # each later stage-1 call covers 4x the previous prefix: few calls even for a full hit


class StagedLookup:
    """One lookup as a sequence of batch existence checks: next_keys(), then record() their answers, until done."""

    def __init__(self, geo: Geometry, block_hashes: Sequence[bytes], num_tokens: int, *, eagle: bool = False) -> None:
        self.geo, self.num_tokens, self.eagle = geo, num_tokens, eagle
        self.n = check_probe_count(geo, len(block_hashes), num_tokens)
        self._hashes = block_hashes[: self.n]
        self._suffixes: list[str] = []
        u = geo.layout.hash_block_size
        self._probed = [geo.probed_boundaries(g, self.n) for g in geo.groups]
        self._rows = [[False] * self.n for _ in geo.groups]  # quorum of what was probed; unprobed reads absent
        self._known = [0] * len(geo.groups)  # per group: every probed hash index below this has been probed
        cap = max(0, min(num_tokens - 1, self.n * u))
        self._cap = cap - cap % geo.unit
        cheapest = min(geo.groups, key=lambda g: (g.keys_per_boundary, not _prefix_bound(g), g.index))
        self._first = cheapest
        self._chunk = _round_up(FIRST_CHUNK, cheapest.span // u)
        self._stage = 1 if self.n and self._cap else 3
        self._pending: list[tuple[GroupGeometry, range]] = []
        self._bound = 0  # stage 1's upper bound on the hit, in tokens
        self._hit: Hit | None = None if self._stage != 3 else Hit(0, (0,) * len(geo.groups))
        self.probes = 0  # keys asked so far

    @property
    def done(self) -> bool:
        """Whether the answer is final."""
        return self._hit is not None

    def answer(self) -> Hit:
        """The final answer: exactly what probing every key would give."""
        if self._hit is None:
            raise RequestMismatch("this lookup still has keys to probe")
        return self._hit

    def next_keys(self) -> list[str]:
        """The keys of the next batch existence check (call only while not done)."""
        if self._hit is not None:
            raise RequestMismatch("this lookup is already answered")
        if self._stage == 1:
            g = self._first
            upto = self.n if not _prefix_bound(g) else min(self.n, self._known[g.index] + self._chunk)
            self._chunk *= _GROWTH
            self._pending = [(g, self._unprobed(g, upto))]
        elif self._stage == 2:
            self._pending = [(g, self._unprobed(g, self._stage_two_end(g))) for g in self.geo.groups]
        else:
            self._pending = [(g, self._unprobed(g, self.n)) for g in self.geo.groups]
        keys: list[str] = []
        for g, idx in self._pending:
            sub = self._suffixes_for(idx)
            for prefix in g.lookup_prefixes:
                keys += map(prefix.__add__, sub)
        self.probes += len(keys)
        return keys

    def record(self, present: Sequence[bool]) -> None:
        """The answers to the keys next_keys() gave, in order; advances to the next stage or the answer."""
        expected = sum(len(idx) * g.keys_per_boundary for g, idx in self._pending)
        if len(present) != expected:
            raise RequestMismatch(f"expected {expected} probe results, got {len(present)}")
        pos = 0
        for g, idx in self._pending:
            m = len(idx)
            runs = [present[pos + ns * m : pos + (ns + 1) * m] for ns in range(g.keys_per_boundary)]
            pos += m * g.keys_per_boundary
            quorum = list(map(bool, runs[0])) if len(runs) == 1 else list(map(all, zip(*runs, strict=True)))
            if m:
                self._rows[g.index][idx.start : idx.stop : idx.step] = quorum
                self._known[g.index] = idx[-1] + 1
        self._pending = []
        if self._stage == 1:
            self._after_stage_one()
        elif self._stage == 2:
            self._after_stage_two()
        else:
            self._hit = compute_hit(self.geo, self.num_tokens, self._rows, eagle=self.eagle)

    def _after_stage_one(self) -> None:
        g = self._first
        if _prefix_bound(g):
            missing = self._first_missing_block(g)
            if missing is None and self._unprobed(g, self.n):
                return  # no block missing yet: probe a longer prefix
            # Every length reaching block `missing`'s end needs it whole; hits are multiples of the unit.
            end = (missing + 1) * g.span - 1 if missing is not None else self._cap
            bound = min(self._cap, end - end % self.geo.unit)
        else:
            # The others taken as fully stored: the hit this group alone allows, an upper bound.
            rows = [r if h is g else _filled(r, self._probed[h.index], 0) for h, r in self._by_group()]
            bound = compute_hit(self.geo, self.num_tokens, rows).hit_tokens
        if bound == 0:
            self._hit = Hit(0, (0,) * len(self.geo.groups))
            return
        self._bound = bound
        self._stage = 2

    def _after_stage_two(self) -> None:
        if not self.eagle:
            # Every length <= bound and its tail is decided by what was probed, and the hit is <= bound.
            m = max(self._stage_two_end(g) for g in self.geo.groups)
            self._hit = compute_hit(self.geo, self.num_tokens, [row[:m] for row in self._rows])
            return
        absent = compute_hit(self.geo, self.num_tokens, self._rows, eagle=True)
        rows = [_filled(r, self._probed[g.index], self._known[g.index]) for g, r in self._by_group()]
        if compute_hit(self.geo, self.num_tokens, rows, eagle=True) == absent:
            self._hit = absent
        else:
            self._stage = 3

    def _by_group(self) -> zip[tuple[GroupGeometry, list[bool]]]:
        return zip(self.geo.groups, self._rows, strict=True)

    def _suffixes_for(self, idx: range) -> list[str]:
        """`@<hex>` of the hashes at idx, each computed once per lookup (stages and groups share them)."""
        if idx.stop > len(self._suffixes):
            self._suffixes += hash_suffixes(self._hashes[len(self._suffixes) : idx.stop])
        return self._suffixes[idx.start : idx.stop : idx.step]

    def _stage_two_end(self, g: GroupGeometry) -> int:
        """Hash indices below this decide every length up to the bound (EAGLE: one unit more) for group g."""
        u = self.geo.layout.hash_block_size
        reach = self._bound + (self.geo.unit if self.eagle else 0)
        return min(self.n, _round_up(reach, g.span) // u)

    def _unprobed(self, g: GroupGeometry, upto: int) -> range:
        probed = self._probed[g.index]
        start = max(probed.start, self._known[g.index])
        start += (probed.start - start) % probed.step
        return range(start, max(start, min(upto, probed.stop)), probed.step)

    def _first_missing_block(self, g: GroupGeometry) -> int | None:
        """The first block of g whose end boundary is not stored, among those probed so far."""
        per_block = g.span // self.geo.layout.hash_block_size
        ends = self._rows[g.index][per_block - 1 : self._known[g.index] : per_block]
        try:
            return ends.index(False)
        except ValueError:
            return None


def _prefix_bound(g: GroupGeometry) -> bool:
    """Whether a missing block rules out every longer length (attention over the whole history)."""
    return g.spec.attention and g.spec.attention_window is None


def _filled(row: list[bool], probed: range, known: int) -> list[bool]:
    """row with every probed index from known on taken as stored."""
    out = list(row)
    start = max(probed.start, known)
    start += (probed.start - start) % probed.step
    out[start : probed.stop : probed.step] = [True] * len(range(start, probed.stop, probed.step))
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
