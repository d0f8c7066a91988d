"""Hypothesis properties of the placement core, against independent models.

- the byte-identity oracle (testing/kvsidecar_testing/oracle.py): who holds identical bytes;
- a brute-force reading of rule 8 (below): which lengths a stored set can serve.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar_contract.placement import (
    Geometry,
    GroupSpec,
    Kind,
    Layout,
    Parallel,
    compute_hit,
    load_plan,
    lookup_plan,
    save_plan,
    save_spans,
)
from kvsidecar_testing.oracle import group_bytes
from support.ranks import all_ranks

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIMPLE = [Kind.FULL_ATTENTION, Kind.SLIDING_WINDOW, Kind.MLA, Kind.SLIDING_WINDOW_MLA, Kind.MAMBA]


@st.composite
def group_specs(draw: st.DrawFn, u: int) -> GroupSpec:
    block = u * draw(st.sampled_from([1, 2, 3, 4]))
    if draw(st.integers(0, 4)) == 0:
        inner = tuple(draw(st.lists(st.sampled_from(SIMPLE), min_size=1, max_size=3)))
        window = u * draw(st.integers(1, 8)) if any(k.sliding for k in inner) else 0
        return GroupSpec(Kind.UNIFORM, block, window, inner)
    kind = draw(st.sampled_from(SIMPLE))
    return GroupSpec(kind, block, u * draw(st.integers(1, 8)) if kind.sliding else 0)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    t = draw(st.sampled_from([1, 2, 4, 8]))
    c = draw(st.sampled_from([1, 2]))
    # The DCP sizes vLLM's ParallelConfig accepts: D divides T without PCP; D in {1, C, T * C} with it.
    d = draw(st.sampled_from([x for x in (1, 2, 4) if t % x == 0] if c == 1 else sorted({1, c, t * c})))
    u = draw(st.sampled_from([1, 2, 4]))
    groups = tuple(draw(st.lists(group_specs(u), min_size=1, max_size=3)))
    # The engine may say how it aligns hits (vLLM's alignment covers groups the store never sees): a multiple of
    # every span without fine-grained hits, or fine-grained hits on U.
    spans = [g.block_size if g.recurrent else g.block_size * d for g in groups]
    given = draw(
        st.sampled_from(
            [{}, {"hit_alignment_tokens": math.lcm(*spans) * draw(st.integers(1, 3))}, {"fine_grained_hits": True}]
        )
    )
    return Layout(
        "org/Model",
        groups,
        Parallel(
            tp_size=t,
            pp_size=draw(st.sampled_from([1, 2])),
            pcp_size=c,
            dcp_size=d,
        ),
        num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
        hash_block_size=u,
        cache_prefix=draw(st.sampled_from(["", "tenant"])),
        **given,
    )


def hashes_for(num_tokens: int, u: int, salt: int = 0) -> list[bytes]:
    return [(salt * 100_000 + i).to_bytes(32, "big") for i in range(num_tokens // u)]


def block_ids(layout: Layout, n: int) -> list[list[int]]:
    return [list(range(1000 * g, 1000 * g + n + 1)) for g in range(len(layout.groups))]


def brute_serves(geo: Geometry, g: int, row: list[bool], length: int) -> bool:
    """Rule 8 read literally, with set membership and loops."""
    group, u = geo.groups[g], geo.layout.hash_block_size
    spec, s = group.spec, group.span

    def stored(b: int) -> bool:
        return b % u == 0 and 1 <= b // u <= len(row) and row[b // u - 1]

    if length == 0:
        return True
    # A hit ends inside a block only with fine-grained hits, and never inside a sliding window's (vLLM's
    # SlidingWindowManager has no lookup inside a block).
    if length % s and not (geo.fine_grained and not any(k.sliding for k in spec.members)):
        return False
    if spec.recurrent and not stored(length):
        return False
    if not spec.attention:
        return True
    window = spec.attention_window
    for k in range(length):
        start, end = k * s, (k + 1) * s
        if start >= length:
            break
        if window is not None and end <= length - max(window, 2) + 1:
            continue  # outside the window: the next token attends to the last W - 1 tokens only (at least one)
        if end <= length:
            if not stored(end):
                return False
        elif not any(stored(b) for b in range(length, end + 1)):
            return False
    return True


def brute_hit(geo: Geometry, num_tokens: int, rows: list[list[bool]], eagle: bool) -> int:
    u, unit = geo.layout.hash_block_size, geo.unit
    n = len(rows[0])
    cap = max(0, min(num_tokens - 1, n * u))
    cap -= cap % unit

    def best(limit: int, groups: list[int]) -> int:
        length = limit
        while length and not all(brute_serves(geo, g, rows[g], length) for g in groups):
            length -= unit
        return length

    every = list(range(len(geo.groups)))
    attention = [g for g in every if not geo.groups[g].spec.recurrent]
    start = cap
    if eagle and attention:
        start = max(0, best(cap, attention) - unit)
    return best(start, every)


def cold_pass(layout: Layout, saves: list[int]) -> dict[str, set[tuple]]:
    """Every rank saves every prompt length; returns key -> set of (rank, bytes identity, boundary)."""
    u = layout.hash_block_size
    written: dict[str, set[tuple]] = defaultdict(set)
    hashes = hashes_for(max(saves), u)
    for num_tokens in saves:
        per_save: dict[str, int] = defaultdict(int)
        for (r, c, p), geo in all_ranks(layout):
            plan = save_plan(geo, hashes, block_ids(layout, len(hashes)), num_tokens)
            for chunk in plan.chunks:
                per_save[chunk.key] += 1
                identity = group_bytes(layout, layout.groups[chunk.group], r, c, p)
                written[chunk.key].add(((r, c, p), identity, chunk.boundary))
        # Inside one save, each value is written by exactly one rank of its replication set.
        assert set(per_save.values()) <= {1}, per_save
    return written


@SETTINGS
@given(layouts(), st.lists(st.integers(1, 40), min_size=1, max_size=3), st.integers(1, 48), st.booleans())
def test_cold_then_warm_every_rank_loads_only_its_own_bytes(layout, saves, lookup_tokens, eagle):
    u = layout.hash_block_size
    saves = [x * u + x % u for x in saves]  # some lengths end mid-unit
    written = cold_pass(layout, saves)
    # Two ranks share a key only if they hold identical bytes at the same boundary.
    for key, writers in written.items():
        assert len({(identity, b) for _, identity, b in writers}) == 1, key

    lookup_tokens = min(lookup_tokens * u, max(saves) + u)
    hashes = hashes_for(max(saves) + u, u)[: lookup_tokens // u]
    ranks = all_ranks(layout)
    scheduler = ranks[0][1]
    plan = lookup_plan(scheduler, hashes, lookup_tokens)
    rows = plan.stored([k in written for k in plan.keys])
    hit = compute_hit(scheduler, lookup_tokens, rows, eagle=eagle)
    assert hit.hit_tokens == brute_hit(scheduler, lookup_tokens, rows, eagle)
    for (r, c, p), geo in ranks:
        own = group_bytes
        for chunk in load_plan(geo, hashes, block_ids(layout, len(hashes)), hit.hit_tokens, hit.tail_boundaries):
            # Servable by every namespace: the key was written, by a rank holding exactly these bytes.
            assert chunk.key in written, chunk
            mine = own(layout, layout.groups[chunk.group], r, c, p)
            assert {identity for _, identity, _ in written[chunk.key]} == {mine}, chunk


@SETTINGS
@given(layouts(), st.integers(1, 30), st.booleans(), st.integers(0, 2**32 - 1))
def test_random_stored_sets_hit_is_maximal_servable_and_every_key_matters(layout, n, eagle, seed):
    rng = random.Random(seed)
    u = layout.hash_block_size
    num_tokens = n * u + rng.randrange(u)
    hashes = hashes_for(num_tokens, u)
    ranks = all_ranks(layout)
    scheduler = ranks[0][1]
    plan = lookup_plan(scheduler, hashes, num_tokens)
    keep = rng.choice([0.7, 0.9, 0.97, 1.0])
    present = {k for k in plan.keys if rng.random() < keep}
    rows = plan.stored([k in present for k in plan.keys])
    hit = compute_hit(scheduler, num_tokens, rows, eagle=eagle)
    assert hit.hit_tokens == brute_hit(scheduler, num_tokens, rows, eagle)
    assert hit.hit_tokens % scheduler.unit == 0 and hit.hit_tokens <= max(0, num_tokens - 1)
    needed: set[str] = set()
    for _, geo in ranks:
        keys = {c.key for c in load_plan(geo, hashes, block_ids(layout, n), hit.hit_tokens, hit.tail_boundaries)}
        assert keys <= present  # a reported hit is servable by every namespace
        needed |= keys
    for key in sorted(needed):
        rows_without = plan.stored([k in present and k != key for k in plan.keys])
        after = compute_hit(scheduler, num_tokens, rows_without, eagle=eagle)
        # A missing key lowers the hit, unless it was a tail with another stored boundary in its block.
        assert after.hit_tokens < hit.hit_tokens or (
            after.hit_tokens == hit.hit_tokens and after.tail_boundaries != hit.tail_boundaries
        ), key
        assert after.hit_tokens <= hit.hit_tokens


@SETTINGS
@given(layouts(), st.integers(1, 40), st.integers(0, 40))
def test_resumed_saves_write_each_value_once(layout, total, resume):
    """A save resumed after saved_tokens writes the rest; together they equal one save of everything."""
    u = layout.hash_block_size
    total *= u
    resume = min(resume * u, total)
    hashes = hashes_for(total, u)
    for _, geo in all_ranks(layout):
        ids = block_ids(layout, len(hashes))
        whole = {c.key for c in save_plan(geo, hashes, ids, total).chunks}
        first = {c.key for c in save_plan(geo, hashes, ids, resume).chunks}
        rest = {c.key for c in save_plan(geo, hashes, ids, total, saved_tokens=resume).chunks}
        assert whole <= first | rest
        assert not any(c.boundary <= resume for c in save_plan(geo, hashes, ids, total, resume).chunks)


def write_volume(layout: Layout, num_tokens: int) -> float:
    """Values written by every rank of one cold save, per distinct value (bytes identity x boundary) they hold."""
    hashes = hashes_for(num_tokens, layout.hash_block_size)
    writes = 0
    held: set[tuple] = set()
    for (r, c, p), geo in all_ranks(layout):
        ids = block_ids(layout, len(hashes))
        writes += len(save_plan(geo, hashes, ids, num_tokens).chunks)
        for g, group in enumerate(geo.groups):
            identity = group_bytes(layout, layout.groups[g], r, c, p)
            spans = save_spans(group.spec, group.span, layout.hash_block_size, group.fine, num_tokens)
            held |= {(g, identity, b) for _, b in spans}
    return writes / len(held)


DCP_GROUPS = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 64))


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize(("tp", "pcp", "dcp"), [(8, 1, 2), (8, 1, 4), (8, 1, 1), (8, 2, 2), (4, 2, 8), (2, 2, 4)])
def test_write_volume_is_one_under_dcp(tp, pcp, dcp, heads):
    """Every distinct value is written once: ranks with the same heads and DCP slice share one write (vllm#51386)."""
    layout = Layout("M", DCP_GROUPS, Parallel(tp_size=tp, pcp_size=pcp, dcp_size=dcp), num_kv_heads=heads)
    assert write_volume(layout, 40 * 64 + 5) == 1.0
