"""Rule 11: one cache across TP sizes, checked over T in {1,2,4,8} x H in {1,2,8} x every kind.

Writers of one TP size save a prompt; readers of another TP size look it up and load it. What each value holds is
taken from the byte oracle (kvsidecar_testing.oracle.member_bytes: which heads, which latent, which state shard a
rank holds), never from the placement code, so the check is: every key a reader loads was written, by exactly one
writer rank, with exactly the bytes the reader's own rank would hold there; a group that cannot be shared is a miss
for another TP size, never another layout's bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvsidecar_contract.placement import (
    Geometry,
    GroupSpec,
    InvalidLayout,
    Kind,
    Layout,
    Parallel,
    compute_hit,
    load_plan,
    lookup_plan,
    save_plan,
)
from kvsidecar_testing.oracle import member_bytes
from support.ranks import all_ranks

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 8)
GROUPS = (
    GroupSpec(Kind.FULL_ATTENTION, 16),
    GroupSpec(Kind.SLIDING_WINDOW, 16, 32),
    GroupSpec(Kind.MLA, 16),
    GroupSpec(Kind.SLIDING_WINDOW_MLA, 16, 32),
    GroupSpec(Kind.MAMBA, 16),
    GroupSpec(Kind.UNIFORM, 16, 32, (Kind.SLIDING_WINDOW, Kind.FULL_ATTENTION)),
    GroupSpec(Kind.UNIFORM, 16, 32, (Kind.MLA, Kind.SLIDING_WINDOW_MLA)),
    GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.FULL_ATTENTION)),
    GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.MAMBA)),
)
# Which kinds the rule shares, written out by hand: whole KV heads, or a latent every rank holds alike.
SHARED = {0: True, 1: True, 2: True, 3: True, 4: False, 5: True, 6: True, 7: False, 8: False}
TOKENS = 64
HASHES = [bytes([i + 1]) * 32 for i in range(TOKENS // 16)]


def layout(group: GroupSpec, tp: int, heads: int, rank: int = 0, share: int | None = None) -> Layout:
    """The engine at TP `tp` seen from `rank`, sharing across TP sizes (by default one value per KV head)."""
    return Layout(
        "org/M", (group,), Parallel(tp_size=tp, tp_rank=rank), heads, 16, value_identity="w",
        share_tp_size=heads if share is None else share,
    )  # fmt: skip


def value_bytes(group: GroupSpec, tp: int, heads: int, rank: int, part: int, parts: int, shared: bool) -> Hashable:
    """What part `part` of `parts` of a rank's block holds, by the oracle: its slice of the rank's heads (or the
    latent, whole) where the group is shared; where it is not, bytes no other layout holds."""
    held = tuple(member_bytes(k, rank, tp, heads, 1) for k in group.members)
    if not shared:
        return (tp, held)  # the ranks of one byte class hold these bytes at this TP size only
    out = []
    for h in held:
        if h[0] == "heads":
            k = len(h[1]) // parts
            out.append(("heads", h[1][part * k : (part + 1) * k], h[2]))
        else:
            assert parts == 1, "only whole heads are cut"
            out.append(h)
    return tuple(out)


def saved(group: GroupSpec, g: int, tp: int, heads: int, share: int | None = None) -> dict[str, Hashable]:
    """Every value the writer ranks store for a 64-token prompt, by key; each key written by one rank only."""
    out: dict[str, Hashable] = {}
    for r in range(tp):
        geo = Geometry.of(layout(group, tp, heads, r, share))
        plan = save_plan(geo, HASHES, [[10 + i for i in range(len(HASHES))]], TOKENS)
        for c in plan.chunks:
            assert c.key not in out, f"{c.key} written twice (write volume must be one copy of each value)"
            out[c.key] = value_bytes(group, tp, heads, r, c.part, c.parts, SHARED[g])
    return out


def divisible(tp: int, heads: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


def compatible(tp: int, heads: int, share: int) -> bool:
    """By hand: a rank holds whole values when T divides G = min(H, N), or when G = H (then any T, as vLLM allows)."""
    groups = min(heads, share)
    return groups % tp == 0 if tp <= groups else groups == heads


SHARES = (None, 2)  # one value per KV head; values as a TP=2 engine holds its heads
CASES = [
    (g, h, n, w, r)
    for g, h, n, w, r in itertools.product(range(len(GROUPS)), HEADS, SHARES, TPS, TPS)
    if not GROUPS[g].gqa
    or (divisible(w, h) and divisible(r, h) and (n is None or (compatible(w, h, n) and compatible(r, h, n))))
]


@pytest.mark.parametrize(("g", "heads", "share", "writer_tp", "reader_tp"), CASES)
def test_a_reader_of_any_tp_size_loads_exactly_its_own_bytes_or_misses(g, heads, share, writer_tp, reader_tp):
    group = GROUPS[g]
    written = saved(group, g, writer_tp, heads, share)
    for r in range(reader_tp):
        geo = Geometry.of(layout(group, reader_tp, heads, r, share))
        probes = lookup_plan(geo, HASHES, TOKENS + 1).keys
        found = [k in written for k in probes]
        chunks = load_plan(geo, HASHES, [[20 + i for i in range(len(HASHES))]], TOKENS, (TOKENS,))
        if SHARED[g] or writer_tp == reader_tp:
            assert all(found), "every boundary is stored in every namespace the reader probes"
            for c in chunks:
                assert written[c.key] == value_bytes(group, reader_tp, heads, r, c.part, c.parts, SHARED[g])
        else:
            assert not any(found), "another layout's values are never found"
            assert not any(c.key in written for c in chunks)


@pytest.mark.parametrize(("heads", "share", "tp"), [(8, 2, 4), (8, 2, 8), (2, 1, 2), (8, 3, 1)])
def test_a_tp_size_that_cannot_hold_whole_values_is_refused_with_the_reason(heads, share, tp):
    with pytest.raises(InvalidLayout, match=f"share_tp_size {share}"):
        layout(GroupSpec(Kind.FULL_ATTENTION, 16), tp, heads, 0, share)
    Geometry.of(layout(GroupSpec(Kind.MLA, 16), tp, heads, 0, share))  # the latent is whole on every rank


@pytest.mark.parametrize(("g", "heads", "tp"), [(g, h, t) for g in range(len(GROUPS)) for h in HEADS for t in TPS])
def test_each_distinct_value_is_written_once_and_shared_groups_store_one_per_head(g, heads, tp):
    group = GROUPS[g]
    if group.gqa and not divisible(tp, heads):
        pytest.skip("H and T must divide one another")
    written = saved(group, g, tp, heads)  # asserts one writer per key
    blocks = TOKENS // 16
    if group.head_split:
        assert len(written) == blocks * heads
        assert len(set(written.values())) == heads
    elif SHARED[g]:
        assert len(written) == blocks
    for r in range(tp):
        geo = Geometry.of(layout(group, tp, heads, r))
        assert geo.groups[0].shared is SHARED[g]
        # What the client cuts its regions by (no keys) agrees with the namespaces the daemon writes.
        assert len(geo.groups[0].own) == layout(group, tp, heads, r).values_per_block(0)


def test_exact_keys_of_a_gqa_group_shared_across_tp():
    group = GroupSpec(Kind.FULL_ATTENTION, 16)
    t1 = Geometry.of(layout(group, 1, 2))
    vid = layout(group, 1, 2).group_value_id(0)
    assert vid == "826743c2e6a0eb7bc159c5c6"
    assert layout(group, 1, 2, share=8).group_value_id(0) == vid  # N >= H: one value per head, whatever N
    assert t1.groups[0].own == (f"kvs1@@M~{vid}@s0.c0.d0.p0.g0", f"kvs1@@M~{vid}@s1.c0.d0.p0.g0")
    assert [Geometry.of(layout(group, 2, 2, r)).groups[0].own for r in (0, 1)] == [
        (f"kvs1@@M~{vid}@s0.c0.d0.p0.g0",),
        (f"kvs1@@M~{vid}@s1.c0.d0.p0.g0",),
    ]
    # T = 4 > H = 2: ranks 2 and 3 both hold head 1 and stripe its blocks between them (rule 4).
    g3 = Geometry.of(layout(group, 4, 2, 3)).groups[0]
    assert (g3.own, g3.factor, g3.member) == ((f"kvs1@@M~{vid}@s1.c0.d0.p0.g0",), 2, 1)
    assert t1.groups[0].lookup_prefixes == g3.lookup_prefixes
    # share_tp_size 2 with 8 heads: values of four heads; a TP=1 rank cuts its block in two, a TP=2 rank holds one.
    coarse = layout(group, 1, 8, share=2)
    cid = coarse.group_value_id(0)
    assert Geometry.of(coarse).groups[0].own == (f"kvs1@@M~{cid}@s0.c0.d0.p0.g0", f"kvs1@@M~{cid}@s1.c0.d0.p0.g0")
    assert Geometry.of(layout(group, 2, 8, 1, share=2)).groups[0].own == (f"kvs1@@M~{cid}@s1.c0.d0.p0.g0",)
    assert Geometry.of(coarse).groups[0].keys_per_boundary == 2
    plan = save_plan(t1, HASHES[:1], [[7]], 16)
    assert [(c.key, c.block_id, c.part, c.parts) for c in plan.chunks] == [
        (f"kvs1@@M~{vid}@s0.c0.d0.p0.g0@{HASHES[0].hex()}", 7, 0, 2),
        (f"kvs1@@M~{vid}@s1.c0.d0.p0.g0@{HASHES[0].hex()}", 7, 1, 2),
    ]


def test_the_shared_value_id_leaves_out_t_and_nothing_else():
    group = GroupSpec(Kind.FULL_ATTENTION, 16)
    base = layout(group, 1, 8)
    assert {layout(group, t, 8).group_value_id(0) for t in TPS} == {base.group_value_id(0)}
    assert base.group_value_id(0) != base.value_id  # never the per-layout namespace
    for other in (
        Layout("org/M", (group,), Parallel(), 8, 16, value_identity="other", share_tp_size=8),
        Layout("org/M", (group,), Parallel(), 4, 16, value_identity="w", share_tp_size=4),
        layout(group, 1, 8, share=2),  # values of four heads
        Layout("org/M", (GroupSpec(Kind.FULL_ATTENTION, 32),), Parallel(), 8, 16, value_identity="w", share_tp_size=8),
        Layout("org/M", (group,), Parallel(pp_size=2), 8, 16, value_identity="w", share_tp_size=8),
    ):
        assert other.group_value_id(0) != base.group_value_id(0)
    # Without the opt-in nothing changes: today's keys, T included.
    plain = Layout("org/M", (group,), Parallel(tp_size=2), 8, 16, value_identity="w")
    assert plain.group_value_id(0) == plain.value_id


def test_a_hybrid_shares_its_attention_and_keeps_its_state_per_layout():
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))

    def geo(tp: int, r: int = 0) -> Geometry:
        return Geometry.of(Layout("M", groups, Parallel(tp_size=tp, tp_rank=r), 2, 16, share_tp_size=8))

    one, two = geo(1), geo(2, 1)
    assert one.groups[0].lookup_prefixes == two.groups[0].lookup_prefixes
    assert not set(one.groups[1].lookup_prefixes) & set(two.groups[1].lookup_prefixes)
    assert [g.shared for g in one.groups] == [True, False]


@pytest.mark.parametrize(("pcp", "dcp"), [(1, 2), (2, 1), (2, 2)])
def test_sharing_under_dcp_or_pcp_is_refused_with_the_reason(pcp, dcp):
    with pytest.raises(InvalidLayout, match="sharing values across TP sizes is not defined under DCP or PCP"):
        Layout(
            "M",
            (GroupSpec(Kind.MLA, 16),),
            Parallel(tp_size=2, pcp_size=pcp, dcp_size=dcp),
            1,
            16,
            share_tp_size=8,
        )


# ---- hypothesis: random hybrids, block sizes, windows, alignment and prompt lengths across two TP sizes ----

SIMPLE = [Kind.FULL_ATTENTION, Kind.SLIDING_WINDOW, Kind.MLA, Kind.SLIDING_WINDOW_MLA, Kind.MAMBA]


def expected_shared(spec: GroupSpec) -> bool:
    """By hand from rule 11: no recurrent member, and either every member a latent kind or none."""
    members = spec.members
    if any(k is Kind.MAMBA for k in members):
        return False
    latent = [k in (Kind.MLA, Kind.SLIDING_WINDOW_MLA) for k in members]
    return all(latent) or not any(latent)


@st.composite
def sharing_cases(draw: st.DrawFn) -> tuple[Layout, Layout, list[int]]:
    u = draw(st.sampled_from([1, 2, 4]))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        block = u * draw(st.sampled_from([1, 2, 3]))
        if draw(st.booleans()):
            inner = tuple(draw(st.lists(st.sampled_from(SIMPLE), min_size=1, max_size=2)))
            window = u * draw(st.integers(1, 6)) if any(k.sliding for k in inner) else 0
            groups.append(GroupSpec(Kind.UNIFORM, block, window, inner))
        else:
            kind = draw(st.sampled_from(SIMPLE))
            groups.append(GroupSpec(kind, block, u * draw(st.integers(1, 6)) if kind.sliding else 0))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    share = draw(st.sampled_from([heads, 16, 2, 4]))
    usable = [t for t in TPS if divisible(t, heads) and compatible(t, heads, share)]
    writer, reader = draw(st.sampled_from(usable)), draw(st.sampled_from(usable))
    fine = draw(st.sampled_from([{}, {"fine_grained_hits": True}]))
    pp = draw(st.sampled_from([1, 2]))

    def at(tp: int) -> Layout:
        return Layout(
            "org/M", tuple(groups), Parallel(tp_size=tp, pp_size=pp), heads, u, value_identity="w",
            share_tp_size=share, **fine,
        )  # fmt: skip

    saves = [x * u + x % u for x in draw(st.lists(st.integers(1, 30), min_size=1, max_size=2))]
    return at(writer), at(reader), saves


def held_bytes(layout: Layout, g: int, rank: int, part: int, parts: int) -> Hashable:
    spec, par = layout.groups[g], layout.parallel
    return value_bytes(spec, par.tp_size, layout.num_kv_heads, rank, part, parts, expected_shared(spec))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sharing_cases(), st.integers(1, 40))
def test_random_layouts_read_across_tp_sizes_only_their_own_bytes(case, lookup_units):
    writer, reader, saves = case
    u = writer.hash_block_size
    hashes = [(i + 1).to_bytes(32, "big") for i in range((max(saves) + u) // u)]
    written: dict[str, set[Hashable]] = {}
    for num_tokens in saves:
        for (r, _c, p), geo in all_ranks(writer):
            ids = [list(range(len(hashes) + 1)) for _ in writer.groups]
            for chunk in save_plan(geo, hashes, ids, num_tokens).chunks:
                held = held_bytes(writer, chunk.group, r, chunk.part, chunk.parts)
                written.setdefault(chunk.key, set()).add((held, p, chunk.boundary))
    for key, holders in written.items():
        assert len(holders) == 1, f"{key} written with different bytes: {holders}"
    lookup_tokens = min(lookup_units * u, max(saves) + u)
    probe = hashes[: lookup_tokens // u]
    ranks = all_ranks(reader)
    plan = lookup_plan(ranks[0][1], probe, lookup_tokens)
    hit = compute_hit(ranks[0][1], lookup_tokens, plan.stored([k in written for k in plan.keys]))
    if writer.parallel.tp_size != reader.parallel.tp_size and not all(expected_shared(g) for g in reader.groups):
        # A group kept per layout is never found by another TP size, and any length > 0 needs it: a miss.
        assert hit.hit_tokens == 0
    event(f"hit > 0 across TP sizes: {hit.hit_tokens > 0 and writer.parallel.tp_size != reader.parallel.tp_size}")
    for (r, _c, p), geo in ranks:
        ids = [list(range(len(probe) + 1)) for _ in reader.groups]
        for chunk in load_plan(geo, probe, ids, hit.hit_tokens, hit.tail_boundaries):
            assert chunk.key in written, chunk
            assert written[chunk.key] == {
                (held_bytes(reader, chunk.group, r, chunk.part, chunk.parts), p, chunk.boundary)
            }
