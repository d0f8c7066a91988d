"""Table-driven checks of factors, shard ids and quorum sizes over the whole grid of layouts."""

import itertools

import pytest

from kvsidecar.testing.oracle import group_bytes
from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, Parallel, replication_factor
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
    """Rule 1 written out as a table lookup per kind, independent of the implementation's branching."""
    if d > 1:
        return 1
    table = {
        Kind.MLA: t,
        Kind.SLIDING_WINDOW_MLA: t,
        Kind.FULL_ATTENTION: max(1, t // h),
        Kind.SLIDING_WINDOW: max(1, t // h),
        Kind.MAMBA: 1,
    }
    return min(table[k] for k in group.members)


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
    (GROUPS[2], 8, 1, 2, 1),  # DCP: every rank its own slice
    (GROUPS[0], 8, 1, 8, 1),
]


@pytest.mark.parametrize(("group", "t", "h", "d", "factor"), HAND)
def test_hand_written_factors(group, t, h, d, factor):
    assert replication_factor(group, t, h, d) == factor


@pytest.mark.parametrize(("t", "h", "d"), [(t, h, d) for t in TPS for h in HEADS for d in DCPS if t % d == 0])
def test_grid_factors_shards_and_quorum(t, h, d):
    for p, c in itertools.product((1, 2), (1, 2)):
        layout = Layout("M", GROUPS, Parallel(tp_size=t, pp_size=p, pcp_size=c, dcp_size=d), num_kv_heads=h)
        geos = [Geometry.of(rank_layout(layout, r)) for r in range(t)]
        for g, spec in enumerate(GROUPS):
            f = expected_factor(spec, t, h, d)
            assert [geo.groups[g].factor for geo in geos] == [f] * t
            assert [geo.groups[g].shard for geo in geos] == [r // f for r in range(t)]
            assert geos[0].groups[g].keys_per_boundary == c * (t // f) * p
            # The quorum is the same from every rank (the scheduler has no rank of its own).
            assert len({geo.groups[g].lookup_prefixes for geo in geos}) == 1
            # Each rank's own namespace is one of the namespaces a lookup requires.
            assert all(geo.groups[g].prefix in geo.groups[g].lookup_prefixes for geo in geos)


@pytest.mark.parametrize(("t", "h", "d"), [(t, h, d) for t in TPS for h in HEADS for d in DCPS if t % d == 0])
def test_grid_namespaces_match_byte_identity(t, h, d):
    """Two ranks share a namespace only if they hold identical bytes; with D = 1, always when they do."""
    layout = Layout("M", GROUPS, Parallel(tp_size=t, dcp_size=d), num_kv_heads=h)
    geos = [Geometry.of(rank_layout(layout, r)) for r in range(t)]
    for g, spec in enumerate(GROUPS):
        for a, b in itertools.combinations(range(t), 2):
            shared = geos[a].groups[g].prefix == geos[b].groups[g].prefix
            identical = group_bytes(layout, spec, a, 0, 0) == group_bytes(layout, spec, b, 0, 0)
            if shared:
                assert identical, (spec.describe(), a, b)
            if d == 1:
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
