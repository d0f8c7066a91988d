"""Table-driven checks of factors, shard ids and quorum sizes over the whole grid of layouts."""

import itertools

import pytest

from kvsidecar_contract.placement import Geometry, GroupSpec, InvalidLayout, Kind, Layout, Parallel, replication_factor
from kvsidecar_testing.oracle import group_bytes
from support.ranks import rank_layout

TPS = (1, 2, 4, 8, 16)
HEADS = (1, 2, 4, 8, 16, 64)
DCPS = (1, 2, 4, 8)
GROUPS = (
    GroupSpec(Kind.FULL_ATTENTION, 16),
    GroupSpec(Kind.SLIDING_WINDOW, 16, 128),
    GroupSpec(Kind.MLA, 16),
    GroupSpec(Kind.SLIDING_WINDOW_MLA, 16, 64),
    GroupSpec(Kind.MAMBA, 64),
    GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.FULL_ATTENTION)),
    GroupSpec(Kind.UNIFORM, 16, 64, (Kind.MLA, Kind.SLIDING_WINDOW_MLA)),
    GroupSpec(Kind.UNIFORM, 16, 32, (Kind.SLIDING_WINDOW, Kind.FULL_ATTENTION)),
    GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.MAMBA)),
    GroupSpec(Kind.UNIFORM, 64, 0, (Kind.MAMBA,)),
)


def expected_factor(group: GroupSpec, t: int, h: int, d: int) -> int:
    """Rule 1 written out as a table lookup per kind, independent of the implementation's branching.

    Under DCP the copies of a value are the ranks with the same heads and the same DCP rank: of the T (latent) or
    T/H (GQA) ranks holding the same heads, every D-th one (the grid's sizes are powers of two, so D divides them
    or exceeds them).
    """
    table = {
        Kind.MLA: max(1, t // d),
        Kind.SLIDING_WINDOW_MLA: max(1, t // d),
        Kind.FULL_ATTENTION: max(1, max(1, t // h) // d),
        Kind.SLIDING_WINDOW: max(1, max(1, t // h) // d),
        Kind.MAMBA: 1,
    }
    return min(table[k] for k in group.members)


def expected_shard(group: GroupSpec, t: int, h: int, r: int) -> int:
    """The heads a rank holds, as the tp_rank field of its keys: r // f without DCP."""
    return r // expected_factor(group, t, h, 1)


# Rows written by hand: (group, T, H, D) -> factor.
HAND = [
    (GROUPS[2], 8, 1, 1, 8),  # MLA replicated on all 8 ranks
    (GROUPS[0], 8, 1, 1, 8),  # one KV head, replicated 8 times
    (GROUPS[0], 8, 2, 1, 4),
    (GROUPS[0], 8, 8, 1, 1),
    (GROUPS[0], 4, 64, 1, 1),
    (GROUPS[4], 8, 1, 1, 1),  # mamba never shares
    (GROUPS[5], 4, 2, 1, 2),  # uniform MLA + GQA: the GQA replication
    (GROUPS[6], 4, 2, 1, 4),  # uniform of MLA kinds only: all ranks
    (GROUPS[8], 4, 1, 1, 1),  # any recurrent member: 1
    (GROUPS[2], 8, 1, 2, 4),  # DCP 2: the latent of one slice on every other rank
    (GROUPS[2], 8, 1, 4, 2),
    (GROUPS[2], 8, 1, 8, 1),  # DCP 8: every rank its own slice
    (GROUPS[0], 8, 2, 2, 2),  # a KV head on 4 ranks, two of each slice
    (GROUPS[0], 8, 2, 4, 1),
    (GROUPS[0], 8, 1, 8, 1),
    (GROUPS[4], 8, 1, 2, 1),  # mamba never shares, DCP or not
]


@pytest.mark.parametrize(("group", "t", "h", "d", "factor"), HAND)
def test_hand_written_factors(group, t, h, d, factor):
    assert replication_factor(group, t, h, d) == factor


@pytest.mark.parametrize(("t", "h", "d"), [(t, h, d) for t in TPS for h in HEADS for d in DCPS if t % d == 0])
def test_grid_factors_shards_and_quorum(t, h, d):
    for p, c in itertools.product((1, 2), (1, 2)):
        if c > 1 and d not in (1, c):
            continue  # vLLM refuses it: with PCP, DCP spans the PCP axis or all of TP x PCP (tested below)
        layout = Layout("M", GROUPS, Parallel(tp_size=t, pp_size=p, pcp_size=c, dcp_size=d), num_kv_heads=h)
        geos = [Geometry.of(rank_layout(layout, r)) for r in range(t)]
        # With D = C the DCP rank is the PCP rank: the TP ranks of one PCP rank hold one slice, as without DCP.
        per_plane = 1 if c > 1 else d
        for g, spec in enumerate(GROUPS):
            f = expected_factor(spec, t, h, per_plane)
            assert [geo.groups[g].factor for geo in geos] == [f] * t
            assert [geo.groups[g].shard for geo in geos] == [expected_shard(spec, t, h, r) for r in range(t)]
            assert geos[0].groups[g].keys_per_boundary == c * (t // f) * p
            # The quorum is the same from every rank (the scheduler has no rank of its own).
            assert len({geo.groups[g].lookup_prefixes for geo in geos}) == 1
            # Each rank's own namespace is one of the namespaces a lookup requires.
            assert all(geo.groups[g].prefix in geo.groups[g].lookup_prefixes for geo in geos)


@pytest.mark.parametrize(("t", "h", "d"), [(t, h, d) for t in TPS for h in HEADS for d in DCPS if t % d == 0])
def test_grid_namespaces_match_byte_identity(t, h, d):
    """Two ranks share a namespace if and only if they hold identical bytes, with DCP or without."""
    layout = Layout("M", GROUPS, Parallel(tp_size=t, dcp_size=d), num_kv_heads=h)
    geos = [Geometry.of(rank_layout(layout, r)) for r in range(t)]
    for g, spec in enumerate(GROUPS):
        for a, b in itertools.combinations(range(t), 2):
            shared = geos[a].groups[g].prefix == geos[b].groups[g].prefix
            identical = group_bytes(layout, spec, a, 0, 0) == group_bytes(layout, spec, b, 0, 0)
            assert shared == identical, (spec.describe(), a, b)


@pytest.mark.parametrize(
    ("groups", "u", "d", "fine", "unit"),
    [
        ((GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 64)), 16, 1, True, 16),
        ((GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MAMBA, 16)), 16, 1, False, 32),
        ((GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.FULL_ATTENTION, 48)), 16, 1, False, 48),
        ((GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MAMBA, 16)), 16, 2, True, 16),
        ((GroupSpec(Kind.FULL_ATTENTION, 16),), 16, 4, False, 64),
        ((GroupSpec(Kind.FULL_ATTENTION, 1536), GroupSpec(Kind.MAMBA, 1536)), 128, 8, True, 128),
    ],
)
def test_alignment_unit(groups, u, d, fine, unit):
    geo = Geometry.of(Layout("M", groups, Parallel(tp_size=8, dcp_size=d), num_kv_heads=8, hash_block_size=u))
    assert (geo.fine_grained, geo.unit) == (fine, unit)


def test_spans_under_dcp():
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MLA, 32), GroupSpec(Kind.MAMBA, 64))
    geo = Geometry.of(Layout("M", groups, Parallel(tp_size=4, dcp_size=4), num_kv_heads=4))
    assert [g.span for g in geo.groups] == [64, 128, 64]


SW32 = GroupSpec(Kind.SLIDING_WINDOW, 32, 128)
MAMBA64 = GroupSpec(Kind.MAMBA, 64)


@pytest.mark.parametrize(
    ("groups", "given", "fine", "unit"),
    [
        # vLLM's SlidingWindowManager cannot look up inside a block: a sliding window longer than U turns
        # fine-grained hits off, and hits align to the least common multiple of the spans.
        ((SW32, MAMBA64), {}, False, 64),
        ((GroupSpec(Kind.SLIDING_WINDOW, 16, 64), MAMBA64), {}, True, 16),  # a window of U-token blocks does not
        ((GroupSpec(Kind.FULL_ATTENTION, 32), MAMBA64), {}, True, 16),
        # What the engine says wins: vLLM's alignment also covers groups the store never sees.
        ((SW32, MAMBA64), {"hit_alignment_tokens": 192}, False, 192),
        ((GroupSpec(Kind.FULL_ATTENTION, 32), MAMBA64), {"hit_alignment_tokens": 64}, False, 64),
        ((GroupSpec(Kind.FULL_ATTENTION, 32), MAMBA64), {"fine_grained_hits": False}, False, 64),
        ((GroupSpec(Kind.FULL_ATTENTION, 32), MAMBA64), {"hit_alignment_tokens": 16}, True, 16),
    ],
)
def test_alignment_from_the_engine(groups, given, fine, unit):
    geo = Geometry.of(Layout("M", groups, Parallel(tp_size=2), num_kv_heads=2, hash_block_size=16, **given))
    assert (geo.fine_grained, geo.unit) == (fine, unit)


def test_alignment_that_splits_a_block_is_refused():
    with pytest.raises(InvalidLayout, match=r"not a multiple of every group's span .* 64"):
        Geometry.of(Layout("M", (SW32, MAMBA64), hash_block_size=16, hit_alignment_tokens=32))


def test_a_sliding_window_never_ends_a_hit_inside_its_block():
    # Even where the engine asks for fine-grained hits, vLLM's sliding-window manager only serves its block ends.
    geo = Geometry.of(Layout("M", (SW32, MAMBA64), hash_block_size=16, fine_grained_hits=True))
    assert geo.unit == 16
    assert [g.fine for g in geo.groups] == [False, True]
    assert geo.probed_boundaries(geo.groups[0], 8) == range(1, 8, 2)
