"""Rule 12: recurrent state stored in pieces any TP size reads, per head (or run of heads) and per B/C group.

Exact slices and keys (the value format), what the value id covers, refusals with their reasons, the quorum and
the striping of pieces several ranks hold, and a hypothesis property over random hybrids: gathered by the cut from
each rank's page as the byte oracle builds it from vLLM's slicing (kvsidecar_testing.states), a piece's bytes are
the same whichever TP size wrote it, every key a reader loads was written, and by exactly one rank.
"""

from __future__ import annotations

import random
from dataclasses import replace

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
    RecurrentState,
    StagedLookup,
    StateAxis,
    StateSegment,
    StateTensor,
    compute_hit,
    load_plan,
    lookup_plan,
    mamba2_state,
    save_plan,
)
from kvsidecar_testing.states import GatedDeltaNet, Kda, Mamba2

H = [bytes([i + 1]) * 32 for i in range(4)]
SMALL = Mamba2(4, 2, 1, 2, conv_bytes=2, ssm_bytes=4)  # 4 heads of 2, one group of state 2, conv window 3


def layout(state: RecurrentState | None, tp: int, rank: int = 0, share: int = 4, **kw) -> Layout:
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16, state=state))
    return Layout("org/M", groups, Parallel(tp_size=tp, tp_rank=rank, **kw), 2, 16, value_identity="w",
                  share_tp_size=share)  # fmt: skip


# ---- the cut, byte for byte ------------------------------------------------------------------------------------------


def test_exact_slices_of_a_small_mamba2_at_tp_1_and_2():
    state = SMALL.state()
    # T=1: conv (3 rows of x 8 + B 2 + C 2 channels, fp16) = 72 bytes, then temporal (4 heads x 2 x 2 fp32).
    assert state.layer_bytes(1) == 72 + 64
    cut = layout(state, 1).value_cut(1)
    assert cut.layer_bytes == 136 and cut.tensor_starts == (0, 72)
    assert cut.pieces == (
        ((0, 4), (24, 4), (48, 4), (72, 16)),  # head 0: its 2 x channels in each conv row, then its temporal state
        ((4, 4), (28, 4), (52, 4), (88, 16)),
        ((8, 4), (32, 4), (56, 4), (104, 16)),
        ((12, 4), (36, 4), (60, 4), (120, 16)),
        ((16, 4), (20, 4), (40, 4), (44, 4), (64, 4), (68, 4)),  # group 0: B then C, in each conv row
    )
    # T=2, rank 1: heads 2-3 and the repeated group 0; the same pieces' sizes at other offsets.
    cut = layout(state, 2, 1).value_cut(1)
    assert cut.layer_bytes == 3 * 8 * 2 + 32
    assert cut.pieces == (
        ((0, 4), (16, 4), (32, 4), (48, 16)),
        ((4, 4), (20, 4), (36, 4), (64, 16)),
        ((8, 4), (12, 4), (24, 4), (28, 4), (40, 4), (44, 4)),
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tensor_has_the_bytes_vllms_shape_calculator_gives_a_rank(tp):
    # vLLM 0.33 MambaStateShapeCalculator, by hand: mamba2 conv (conv_kernel - 1, (H*P + 2*G'*N) / T) with G' the
    # groups extended to T when G = 1, temporal (H / T, P, N); gdn conv (K-1, (2*Hk*Dk + Hv*Dv) / T), temporal
    # (Hv / T, Dv, Dk); kda conv (K-1, 3*H*D / T), temporal (H / T, D, D).
    mamba = Mamba2(8, 4, 1, 2, conv_kernel=4, conv_bytes=2, ssm_bytes=4)
    groups = tp  # 1 + extra_groups_for_head_shards(1, tp)
    assert mamba.state().tensor_bytes(tp) == (3 * ((8 * 4 + 2 * groups * 2) // tp) * 2, 8 // tp * 4 * 2 * 4)
    gdn = GatedDeltaNet(4, 8, 2, 3, conv_kernel=4, conv_bytes=2, ssm_bytes=4)
    assert gdn.state().tensor_bytes(tp) == (3 * ((2 * 4 * 2 + 8 * 3) // tp) * 2, 8 // tp * 3 * 2 * 4)
    kda = Kda(4, 2, conv_kernel=3, conv_bytes=2, ssm_bytes=4)
    assert kda.state().tensor_bytes(tp) == (2 * (3 * 4 * 2 // tp) * 2, 4 // tp * 2 * 2 * 4)
    for layer in (mamba, gdn, kda):
        assert layer.state().layer_bytes(tp) == len(layer.page("any", tp, 0))  # and the byte oracle's page


def test_the_conv_state_dim_first_layout_puts_a_heads_channels_together():
    state = SMALL._replace(dim_first=True).state()
    cut = layout(state, 2, 0).value_cut(1)
    # DS: (channels, window): head 0's two x channels are 2 x 3 contiguous elements.
    assert cut.pieces[0] == ((0, 12), (48, 16))
    assert cut.pieces[2] == ((24, 12), (36, 12))  # the group's B, then its C


def test_a_piece_has_the_same_slice_sizes_at_every_tp_size():
    for state in (SMALL.state(), GatedDeltaNet(4, 8, 2, 2).state(), Kda(4, 2, dim_first=True).state()):
        shapes = set()
        for tp in (1, 2, 4):
            for rank in range(tp):
                lay = layout(state, tp, rank, share=8)
                cut = lay.value_cut(1)
                pieces = lay.values_of_rank(1, rank)
                shapes |= {(v, tuple(size for _, size in s)) for v, s in zip(pieces, cut.pieces, strict=True)}
        assert len(shapes) == len({v for v, _ in shapes})  # one shape per piece


# ---- keys and the value id -------------------------------------------------------------------------------------------


def test_exact_keys_of_a_shared_mamba2_group():
    state = SMALL.state()
    vid = layout(state, 1).group_value_id(1)
    assert vid == "f9afefe6bce4db979720374a"  # pinned: a change is a change of the value format
    prefix = f"kvs1@@M~{vid}"
    assert Geometry.of(layout(state, 1)).groups[1].own == tuple(f"{prefix}@s{v}.c0.d0.p0.g1" for v in range(5))
    assert [Geometry.of(layout(state, 2, r)).groups[1].own for r in (0, 1)] == [
        (f"{prefix}@s0.c0.d0.p0.g1", f"{prefix}@s1.c0.d0.p0.g1", f"{prefix}@s4.c0.d0.p0.g1"),
        (f"{prefix}@s2.c0.d0.p0.g1", f"{prefix}@s3.c0.d0.p0.g1", f"{prefix}@s4.c0.d0.p0.g1"),
    ]
    # Every TP size probes the same five namespaces per boundary.
    assert {Geometry.of(layout(state, t)).groups[1].lookup_prefixes for t in (1, 2, 4)} == {
        tuple(f"{prefix}@s{v}.c0.d0.p0.g1" for v in range(5))
    }
    plan = save_plan(Geometry.of(layout(state, 2, 1)), H[:1], [[9], [7]], 16)
    assert [(c.key, c.block_id, c.part, c.parts) for c in plan.chunks if c.group == 1] == [
        (f"{prefix}@s2.c0.d0.p0.g1@{H[0].hex()}", 7, 0, 3),
        (f"{prefix}@s3.c0.d0.p0.g1@{H[0].hex()}", 7, 1, 3),
        (f"{prefix}@s4.c0.d0.p0.g1@{H[0].hex()}", 7, 2, 3),
    ]
    # The group's piece is striped over its two holders (rule 4, rotated by the group index): chunk 0 is rank 1's.
    plan = save_plan(Geometry.of(layout(state, 2, 0)), H[:1], [[9], [7]], 16)
    assert [c.key.split("@")[3] for c in plan.chunks if c.group == 1] == ["s0.c0.d0.p0.g1", "s1.c0.d0.p0.g1"]


def test_the_state_value_id_leaves_out_t_and_h_and_covers_what_the_bytes_depend_on():
    state = SMALL.state()
    base = layout(state, 1).group_value_id(1)
    assert {layout(state, t, 0).group_value_id(1) for t in (1, 2, 4)} == {base}
    assert replace(layout(state, 1), num_kv_heads=4).group_value_id(1) == base  # attention's heads: not its bytes
    renamed = RecurrentState(tuple(replace(a, name=f"axis{i}") for i, a in enumerate(state.axes)), state.tensors)
    assert layout(renamed, 1).group_value_id(1) == base  # names are for people
    for other in (
        SMALL._replace(dim_first=True).state(),  # SD against DS: same sizes, other bytes
        SMALL._replace(ssm_bytes=2).state(),
        SMALL._replace(conv_kernel=3).state(),
        SMALL._replace(state_size=4, head_dim=1).state(),
        Mamba2(4, 2, 2, 2).state(),
    ):
        assert layout(other, 1).group_value_id(1) != base
    assert layout(state, 1, share=2).group_value_id(1) != base  # pieces of two heads
    assert layout(state, 1, share=16).group_value_id(1) == base  # N >= every axis: one piece per index either way
    assert layout(state, 1).group_value_id(1) != layout(state, 1).value_id  # never today's per-layout namespace


def test_without_sharing_a_state_layout_keeps_per_layout_keys_and_says_what_it_is():
    # Per layout (share_tp_size 0) the state's layout joins the session's value id: SD and DS never share a key.
    plain = layout(None, 2, share=0)
    sd, ds = layout(SMALL.state(), 2, share=0), layout(SMALL._replace(dim_first=True).state(), 2, share=0)
    assert len({plain.value_id, sd.value_id, ds.value_id}) == 3
    geo = Geometry.of(sd.for_rank(1))
    assert (geo.groups[1].own, geo.groups[1].shared) == ((f"kvs1@@M~{sd.value_id}@s1.c0.d0.p0.g1",), False)
    assert sd.value_cut(1) == (1, 1)


# ---- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "tp", "share", "reason"),
    [
        (SMALL.state(), 8, 4, "state axis heads of 4 cannot be sharded over 8 TP ranks"),
        (Mamba2(8, 2, 2, 2).state(), 4, 8, "state axis groups of 2 cannot be sharded over 4 TP ranks"),
        (GatedDeltaNet(2, 4, 2, 2).state(), 4, 4, "state axis k_heads of 2 cannot be sharded"),
        (SMALL.state(), 1, 3, "share_tp_size 3 would cut state axis heads of 4 into 3 equal pieces"),
        (SMALL.state(), 4, 2, "stores state axis heads in pieces of 2; a TP=4 rank holds 1"),
    ],
)
def test_a_layout_whose_state_cannot_be_cut_is_refused_with_the_reason(state, tp, share, reason):
    with pytest.raises(InvalidLayout, match=reason):
        layout(state, tp, share=share)


def test_a_state_layout_is_only_for_recurrent_groups_and_must_map_every_byte_to_an_axis():
    with pytest.raises(InvalidLayout, match="only a group whose members are all recurrent has one"):
        GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MAMBA, Kind.FULL_ATTENTION), state=SMALL.state())
    with pytest.raises(InvalidLayout, match=r"state axes \['groups'\] shard no segment"):
        RecurrentState((StateAxis("heads", 4), StateAxis("groups", 2)), (StateTensor(2, 1, (StateSegment(0, 4),)),))
    with pytest.raises(InvalidLayout, match="a segment names axis 1, the state has 1"):
        RecurrentState((StateAxis("heads", 4),), (StateTensor(2, 1, (StateSegment(1, 4),)),))
    with pytest.raises(InvalidLayout, match="intermediate_size 10 is not whole heads of 4"):
        mamba2_state(
            num_heads=4, head_dim=2, n_groups=1, state_size=2, conv_kernel=4, conv_bytes=2, ssm_bytes=2,
            intermediate_size=10,
        )  # fmt: skip
    with pytest.raises(InvalidLayout, match="would be 5000 byte ranges"):
        RecurrentState((StateAxis("heads", 4),), (StateTensor(2, 5000, (StateSegment(0, 1),)),))


@pytest.mark.parametrize(("pcp", "dcp"), [(1, 2), (2, 1)])
def test_sharing_state_under_dcp_or_pcp_is_refused(pcp, dcp):
    with pytest.raises(InvalidLayout, match="not defined under DCP or PCP"):
        layout(SMALL.state(), 2, pcp_size=pcp, dcp_size=dcp)


# ---- quorum and striping ---------------------------------------------------------------------------------------------


def test_a_repeated_group_is_written_once_per_chunk_and_required_once():
    state = Mamba2(8, 2, 1, 2).state()  # 8 head pieces and one group piece, held by every rank at T = 4
    geos = [Geometry.of(layout(state, 4, r, share=8, pp_size=2)) for r in range(4)]
    assert {g.groups[1].keys_per_boundary for g in geos} == {9 * 2}
    assert [g.groups[1].replicas for g in geos] == [((1, 0), (1, 0), (4, r)) for r in range(4)]
    for chunk in range(8):
        writers = [r for r, g in enumerate(geos) if g.groups[1].writes_part(2, chunk)]
        assert writers == [(chunk - 1) % 4]  # (member + group) mod f == chunk mod f, group 1
    plans = [save_plan(g, H, [[0, 1, 2, 3], [4, 5, 6, 7]], 64) for g in geos]
    keys = [c.key for p in plans for c in p.chunks if c.group == 1]
    assert len(keys) == len(set(keys)) == 4 * 9  # every piece of every block once
    # Each rank leaves 3 of the 4 blocks' group piece to others, and 2 of 4 attention blocks (one head, 2 ranks).
    assert [p.others for p in plans] == [5, 5, 5, 5]


# ---- hypothesis: random hybrids across two TP sizes, bytes gathered from the oracle's pages -------------------------

TPS = (1, 2, 4, 8)


@st.composite
def state_layers(draw: st.DrawFn):
    kind = draw(st.sampled_from(["mamba2", "gdn", "kda"]))
    dim_first = draw(st.booleans())
    if kind == "mamba2":
        heads = draw(st.sampled_from([8, 16]))
        groups = draw(st.sampled_from([1, 2, 4, 8, heads]))
        return Mamba2(heads, draw(st.sampled_from([1, 2])), groups, draw(st.sampled_from([1, 2])),
                      draw(st.sampled_from([2, 4])), draw(st.sampled_from([1, 2])), 4, dim_first)  # fmt: skip
    if kind == "gdn":
        k = draw(st.sampled_from([2, 4, 8]))
        return GatedDeltaNet(k, k * draw(st.sampled_from([1, 2])), 2, draw(st.sampled_from([1, 2])),
                             dim_first=dim_first)  # fmt: skip
    return Kda(draw(st.sampled_from([4, 8])), draw(st.sampled_from([1, 2])), dim_first=dim_first)


@st.composite
def hybrids(draw: st.DrawFn):
    states = draw(st.lists(state_layers(), min_size=1, max_size=2))
    others = draw(st.lists(st.sampled_from([Kind.FULL_ATTENTION, Kind.MLA]), max_size=2))
    order = draw(st.permutations([("s", i) for i in range(len(states))] + [("a", k) for k in others]))
    # State blocks longer than U turn fine-grained hits on (vLLM's align mode); attention blocks of 1 or 2 U.
    blocks = [draw(st.sampled_from([16, 32, 64] if t == "s" else [16, 32])) for t, _ in order]
    groups = tuple(
        GroupSpec(Kind.MAMBA, b, state=states[x].state()) if t == "s" else GroupSpec(x, b)
        for (t, x), b in zip(order, blocks, strict=True)
    )
    layers = {g: states[x] for g, (t, x) in enumerate(order) if t == "s"}
    heads = 8
    sizes = [a.size for s in states for a in s.state().axes]
    share = draw(st.sampled_from([max(heads, *sizes), 2, 4, 8]))
    valid = []
    for tp in TPS:
        try:
            Layout("M", groups, Parallel(tp_size=tp), heads, 16, share_tp_size=share)
        except InvalidLayout:
            continue
        if all(layer.supports(tp) for layer in layers.values()):
            valid.append(tp)
    if not valid:
        event("no TP size can share this cut")
        return None
    writer = draw(st.sampled_from(valid))
    reader = draw(st.sampled_from([t for t in valid if t != writer] or valid))
    pp = draw(st.sampled_from([1, 2]))

    def at(tp: int) -> Layout:
        return Layout("org/M", groups, Parallel(tp_size=tp, pp_size=pp), heads, 16, value_identity="w",
                      share_tp_size=share)  # fmt: skip

    return at(writer), at(reader), layers


def piece_bytes(lay: Layout, layer, g: int, rank: int, part: int, boundary: int) -> bytes:
    """A piece of layer 0's state, gathered by the cut from the rank's page as the byte oracle builds it."""
    page = layer.page(f"g{g}|{boundary}", lay.parallel.tp_size, rank)
    cut = lay.value_cut(g)
    return b"".join(page[offset : offset + size] for offset, size in cut.pieces[part])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(hybrids(), st.sampled_from([16, 48, 64]))
def test_random_hybrids_read_exactly_the_state_another_tp_size_wrote(case, saved):
    if case is None:
        return
    writer, reader, layers = case
    written: dict[str, tuple[int, bytes]] = {}
    for r in range(writer.parallel.tp_size):
        for p in range(writer.parallel.pp_size):
            lay = writer.for_rank(r, 0, p)
            ids = [list(range(4)) for _ in writer.groups]
            for c in save_plan(Geometry.of(lay), H, ids, saved).chunks:
                assert c.key not in written, f"{c.key} written by ranks {written.get(c.key, (None,))[0]} and {r}"
                data = piece_bytes(lay, layers[c.group], c.group, r, c.part, c.boundary) if c.group in layers else b""
                written[c.key] = (r, data)
    hits = []
    for lay in (writer, reader):
        geo = Geometry.of(lay)
        plan = lookup_plan(geo, H, 65)
        hits.append(compute_hit(geo, 65, plan.stored([k in written for k in plan.keys])))
    # A reader of another TP size hits exactly where the writer's own TP size would: every piece is found.
    hit = hits[1]
    assert hit == hits[0]
    event(f"across TP sizes: {writer.parallel.tp_size != reader.parallel.tp_size}, hit: {hit.hit_tokens > 0}")
    for r in range(reader.parallel.tp_size):
        for p in range(reader.parallel.pp_size):
            lay = reader.for_rank(r, 0, p)
            ids = [list(range(4)) for _ in reader.groups]
            for c in load_plan(Geometry.of(lay), H, ids, hit.hit_tokens, hit.tail_boundaries):
                assert c.key in written, c
                if c.group in layers:
                    assert written[c.key][1] == piece_bytes(lay, layers[c.group], c.group, r, c.part, c.boundary)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(hybrids(), st.integers(1, 6), st.booleans(), st.integers(0, 2**32 - 1))
def test_staged_lookups_of_state_pieces_answer_what_probing_every_key_answers(case, units, eagle, seed):
    if case is None:
        return
    _, reader, _ = case
    rng = random.Random(seed)
    geo = Geometry.of(reader)
    tokens = units * 16 + rng.randrange(16)
    hashes = [bytes([i + 1]) * 32 for i in range(tokens // 16)]
    plan = lookup_plan(geo, hashes, tokens)
    # Stored below a random cut, each piece's key missing now and then: the quorum must see every piece.
    cut = rng.randrange(len(hashes) + 1)
    answer = {k: int(k.rsplit("@", 1)[1][-2:], 16) <= cut and rng.random() < 0.97 for k in plan.keys}
    every = compute_hit(geo, tokens, plan.stored([answer[k] for k in plan.keys]), eagle=eagle)
    staged = StagedLookup(geo, hashes, tokens, eagle=eagle)
    while not staged.done:
        staged.record([answer[k] for k in staged.next_keys()])
    assert staged.answer() == every
