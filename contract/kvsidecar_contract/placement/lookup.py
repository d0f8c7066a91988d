"""Lookups (rules 7-10): the keys to probe, the quorum per boundary, and the hit length with its tails."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

from kvsidecar_contract.placement.errors import RequestMismatch
from kvsidecar_contract.placement.geometry import Geometry, GroupGeometry
from kvsidecar_contract.placement.keys import hash_suffixes
from kvsidecar_contract.placement.spans import first_needed_block

MAX_PROBE_KEYS = 2_000_000  # one lookup's keys: a 1M-token prompt at U=16 and T=8 with three groups is ~1.1M


class ProbeRun(NamedTuple):
    """A run of probe keys: one group's probed hash indices, repeated for each of its namespaces."""

    group: int
    hashes: range  # hash indices probed, in key order
    namespaces: int


class LookupPlan(NamedTuple):
    """Every key one lookup probes, in one flat list for a single batch existence check."""

    keys: list[str]
    runs: tuple[ProbeRun, ...]
    num_hashes: int

    def stored(self, present: Sequence[bool]) -> list[list[bool]]:
        """Per group, per hash index: whether that boundary exists in every namespace (rule 7)."""
        if len(present) != len(self.keys):
            raise RequestMismatch(f"expected {len(self.keys)} probe results, got {len(present)}")
        out: list[list[bool]] = []
        pos = 0
        for run in self.runs:
            m = len(run.hashes)
            spaces = [present[pos + ns * m : pos + (ns + 1) * m] for ns in range(run.namespaces)]
            pos += m * run.namespaces
            # map/zip/all run in C: a 128k-token lookup at T=8 folds ~140k probes here.
            quorum = list(map(bool, spaces[0])) if len(spaces) == 1 else list(map(all, zip(*spaces, strict=True)))
            row = [False] * self.num_hashes
            row[run.hashes.start : run.hashes.stop : run.hashes.step] = quorum
            out.append(row)
        return out


class Hit(NamedTuple):
    """A lookup's answer: the prefix every group can serve, and per group the boundary its last block is stored under.

    `degraded` says the store (or the daemon) could not be asked about all of it: the answer may be shorter than
    what is stored, never longer. An engine passes the whole Hit to its load unchanged.
    """

    hit_tokens: int
    tail_boundaries: tuple[int, ...]
    degraded: bool = False
    detail: str = ""  # why it is degraded

    @classmethod
    def miss(cls, num_groups: int, detail: str) -> Hit:
        """A degraded miss: the store (or the daemon) could not be asked."""
        return cls(0, (0,) * num_groups, True, detail)


def lookup_plan(geo: Geometry, block_hashes: Sequence[bytes], num_tokens: int) -> LookupPlan:
    """The probe keys for a prompt of num_tokens tokens with its chained block hashes."""
    n = check_probe_count(geo, len(block_hashes), num_tokens)
    suffixes = hash_suffixes(block_hashes[:n])
    keys: list[str] = []
    runs = []
    for group in geo.groups:
        probed = geo.probed_boundaries(group, n)
        sub = suffixes if probed.step == 1 else suffixes[probed.start :: probed.step]
        for prefix in group.lookup_prefixes:
            keys += map(prefix.__add__, sub)
        runs.append(ProbeRun(group.index, probed, group.keys_per_boundary))
    return LookupPlan(keys, tuple(runs), n)


def check_probe_count(geo: Geometry, num_hashes: int, num_tokens: int) -> int:
    """The block hashes a lookup uses, once the prompt and the keys probing all of it are within limits."""
    n = _check_prompt(geo, num_hashes, num_tokens)
    probes = sum(len(geo.probed_boundaries(g, n)) * g.keys_per_boundary for g in geo.groups)
    if probes > MAX_PROBE_KEYS:
        raise RequestMismatch(
            f"this lookup would probe {probes} keys ({n} block hashes across every namespace), more than "
            f"{MAX_PROBE_KEYS}: look up a shorter prompt"
        )
    return n


def compute_hit(geo: Geometry, num_tokens: int, stored: Sequence[Sequence[bool]], *, eagle: bool = False) -> Hit:
    """Rule 9's fixed point over every group, then rule 10's tail boundaries.

    stored[g][i] says whether the boundary (i + 1) * U of group g exists in every namespace.
    """
    if len(stored) != len(geo.groups):
        raise RequestMismatch(f"expected stored flags for {len(geo.groups)} groups, got {len(stored)}")
    n = len(stored[0]) if stored else 0
    if any(len(row) != n for row in stored):
        raise RequestMismatch("stored flags must cover the same number of boundaries for every group")
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
    """Answers rule 8 for one group in O(log n) per length, from its stored boundaries.

    Built in C-level passes (accumulate, compress): a 128k-token prompt has 8192 boundaries per group, and a miss
    walks down from the cap, so `largest` jumps past lengths a missing block rules out instead of trying each unit.
    """

    def __init__(self, group: GroupGeometry, stored: Sequence[bool], u: int) -> None:
        self.group, self.stored, self.u = group, stored, u
        n = len(stored)
        per_block = group.span // u
        ends = [not stored[i] for i in range(per_block - 1, (n // per_block) * per_block, per_block)]
        # missing[k]: how many of blocks 0..k-1 are not stored whole under their end boundary.
        self.missing = list(itertools.accumulate(ends, operator.add, initial=0))
        # The blocks not stored whole, ascending: the last one before a block is a bisect away.
        self._missing_blocks = list(itertools.compress(range(len(ends)), ends))
        # The stored hash indices, ascending: the first stored index >= i is a bisect away.
        self.positions = list(itertools.compress(range(n), stored))

    def largest(self, hit: int, unit: int) -> int:
        """The largest length <= hit this group can serve (0 always can)."""
        while hit and self.tail(hit) is None:
            hit = self._below(hit, unit)
        return hit

    def _below(self, hit: int, unit: int) -> int:
        """A length < hit (a multiple of unit) with no servable length strictly between it and hit."""
        spec, s, u = self.group.spec, self.group.span, self.u
        below = hit - unit
        if not spec.attention:
            # Servable exactly where stored: the last stored boundary at or under `below`.
            j = bisect.bisect_right(self.positions, below // u - 1) - 1
            return 0 if j < 0 else max(0, (self.positions[j] + 1) * u // unit * unit)
        last = (hit - 1) // s
        whole_end = last + 1 if hit % s == 0 else last
        window = spec.attention_window
        first = first_needed_block(spec, hit, s)
        if window is None:
            # Full attention needs every block from 0: nothing reaching past the first missing block is servable.
            k = self._missing_blocks[0] if self._missing_blocks else -1
            k = k if k < whole_end else -1
        else:
            k = self._last_missing_before(min(whole_end, len(self.missing) - 1))
        if k >= first:
            # Every shorter length whose whole blocks reach past block k needs it too (first only shrinks).
            below = min(below, ((k + 1) * s - 1) // unit * unit)
        return max(0, below)

    def _last_missing_before(self, block: int) -> int:
        i = bisect.bisect_left(self._missing_blocks, block) - 1
        return self._missing_blocks[i] if i >= 0 else -1

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
        first = first_needed_block(spec, hit, s)
        whole_end = last + 1 if at_end else last  # blocks [first, whole_end) must be stored whole
        if whole_end >= len(self.missing) or self.missing[whole_end] - self.missing[min(first, whole_end)]:
            return None
        if at_end:
            return hit
        if not self.group.fine:  # vLLM's manager for this group only serves its own block ends
            return None
        if spec.recurrent:  # a packed value with state in it is only valid at exactly its boundary
            return hit if self.stored[i] else None
        p = bisect.bisect_left(self.positions, i)
        if p == len(self.positions):
            return None
        tail = (self.positions[p] + 1) * u
        return tail if tail <= (last + 1) * s else None


def _check_prompt(geo: Geometry, num_hashes: int, num_tokens: int) -> int:
    u = geo.layout.hash_block_size
    if num_tokens < 0:
        raise RequestMismatch(f"num_tokens must be >= 0, got {num_tokens}")
    if num_hashes > num_tokens // u:
        raise RequestMismatch(
            f"{num_hashes} block hashes cover {num_hashes * u} tokens, more than num_tokens={num_tokens}"
        )
    return num_hashes
