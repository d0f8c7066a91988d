"""The worked examples A-D of docs/placement.md, value for value."""

from kvsidecar_contract.placement import (
    Geometry,
    GroupSpec,
    Hit,
    Kind,
    Layout,
    Parallel,
    compute_hit,
    load_plan,
    lookup_plan,
    save_plan,
)
from support.ranks import rank_layout

HASHES = [i.to_bytes(32, "big") for i in range(1, 200)]


def writers_of_chunk0(layout: Layout, group: int, num_tokens: int) -> list[int]:
    out = []
    for r in range(layout.parallel.tp_size):
        geo = Geometry.of(rank_layout(layout, r))
        plan = save_plan(geo, HASHES, [list(range(64))] * len(layout.groups), num_tokens)
        if any(c.group == group and c.span_index == 0 for c in plan.chunks):
            out.append(r)
    return out


def test_example_a_mixed_mla_gqa_mamba():
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    layout = Layout("M", groups, Parallel(tp_size=4), num_kv_heads=2)
    geos = [Geometry.of(rank_layout(layout, r)) for r in range(4)]
    assert [g.factor for g in geos[0].groups] == [4, 2, 1]
    assert [[geo.groups[g].shard for geo in geos] for g in range(3)] == [
        [0, 0, 0, 0],
        [0, 0, 1, 1],
        [0, 1, 2, 3],
    ]
    assert [g.keys_per_boundary for g in geos[0].groups] == [1, 2, 4]
    assert writers_of_chunk0(layout, 0, 16) == [0]
    assert writers_of_chunk0(layout, 1, 16) == [1, 3]
    assert writers_of_chunk0(layout, 2, 16) == [0, 1, 2, 3]
    uniform = Layout("M", (GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.FULL_ATTENTION)),), layout.parallel, 2)
    assert Geometry.of(uniform).groups[0].factor == 2


def test_example_b_seed_000_mamba_never_shares_a_namespace():
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    layout = Layout("Kimi-Linear", groups, Parallel(tp_size=2), num_kv_heads=1)
    geos = [Geometry.of(rank_layout(layout, r)) for r in range(2)]
    assert [geo.groups[1].prefix for geo in geos] == [
        f"kvs1@@{layout.model_key}@s0.c0.d0.p0.g1",
        f"kvs1@@{layout.model_key}@s1.c0.d0.p0.g1",
    ]
    for geo in geos:  # both ranks write every mamba chunk
        plan = save_plan(geo, HASHES, [list(range(8)), list(range(8))], 64)
        assert [c.span_index for c in plan.chunks if c.group == 1] == [0, 1, 2, 3]
    probe = lookup_plan(geos[0], HASHES[:4], 64)
    mamba_keys = [k for k in probe.keys if ".g1@" in k]
    assert {k.split("@")[3] for k in mamba_keys} == {"s0.c0.d0.p0.g1", "s1.c0.d0.p0.g1"}
    # One rank's state missing at a boundary rejects that boundary.
    present = [not ("@s1.c0.d0.p0.g1@" in k and k.endswith(HASHES[3].hex())) for k in probe.keys]
    stored = probe.stored(present)
    assert stored[1] == [True, True, True, False]
    assert compute_hit(geos[0], 65, stored) == Hit(48, (48, 48))


def test_example_c_seed_002_tail_keys_are_the_stored_boundaries():
    groups = (GroupSpec(Kind.FULL_ATTENTION, 1536), GroupSpec(Kind.MAMBA, 1536))
    layout = Layout("K3", groups, Parallel(tp_size=8, tp_rank=5, dcp_size=8), num_kv_heads=8, hash_block_size=128)
    geo = Geometry.of(layout)
    assert [g.span for g in geo.groups] == [12288, 1536]
    n = 15000 // 128
    stored = [[False] * n, [False] * n]
    for b in (12288, 14848):
        stored[0][b // 128 - 1] = True
    for b in (13824, 14848):
        stored[1][b // 128 - 1] = True
    hit = compute_hit(geo, 15000, stored, eagle=True)
    assert hit == Hit(13824, (14848, 13824))
    hashes = HASHES[:n]
    chunks = load_plan(geo, hashes, [[70, 71], list(range(100, 110))], hit.hit_tokens, hit.tail_boundaries)
    assert [(c.group, c.span_index, c.boundary, c.block_id) for c in chunks] == [
        (0, 0, 12288, 70),
        (0, 1, 14848, 71),
        (1, 8, 13824, 108),
    ]
    head = f"kvs1@@{layout.model_key}@s5.c0.d5.p0"
    assert chunks[1].key == f"{head}.g0@{hashes[14848 // 128 - 1].hex()}"
    assert chunks[2].key == f"{head}.g1@{hashes[13824 // 128 - 1].hex()}"
    # The key the bug derived from the hit length is not what the load reads.
    derived = f"{head}.g0@{hashes[13824 // 128 - 1].hex()}"
    assert derived not in {c.key for c in chunks}
    # Without EAGLE both groups reach 14,848.
    assert compute_hit(geo, 15000, stored) == Hit(14848, (14848, 14848))


def test_example_c_what_the_first_pass_stores():
    # The example's prompt is "about 15,000 tokens": its last U boundary is 14,848, so it had 14,848..14,975.
    groups = (GroupSpec(Kind.FULL_ATTENTION, 1536), GroupSpec(Kind.MAMBA, 1536))
    layout = Layout("K3", groups, Parallel(tp_size=8, dcp_size=8), num_kv_heads=8, hash_block_size=128)
    plan = save_plan(Geometry.of(layout), HASHES, [[0, 1], list(range(10))], 14900)
    attention = [c.boundary for c in plan.chunks if c.group == 0]
    mamba = [c.boundary for c in plan.chunks if c.group == 1]
    assert attention == [12288, 14848]
    assert mamba == [1536 * k for k in range(1, 10)] + [14848]


def test_example_d_full_hit_leaves_the_last_token():
    layout = Layout("M", (GroupSpec(Kind.FULL_ATTENTION, 16),))
    geo = Geometry.of(layout)
    assert compute_hit(geo, 64, [[True] * 4]) == Hit(48, (48,))
    assert compute_hit(geo, 65, [[True] * 4]) == Hit(64, (64,))
    assert compute_hit(geo, 64, [[True] * 4], eagle=True) == Hit(32, (32,))
    assert compute_hit(geo, 1, [[]]) == Hit(0, (0,))


def test_a_sliding_window_needs_the_last_w_minus_1_tokens_as_vllm_counts_them():
    # W = 17 on 16-token blocks: the token after a 64-token hit attends to tokens 48..64, so vLLM's sliding-window
    # manager needs block 3 only (cdiv(W - 1, 16) = 1 block) and gives the load a null block for block 2.
    geo = Geometry.of(Layout("M", (GroupSpec(Kind.SLIDING_WINDOW, 16, 17),), hash_block_size=16))
    stored = [[i == 64 // 16 - 1 for i in range(4)]]
    assert compute_hit(geo, 70, stored) == Hit(64, (64,))
    loads = load_plan(geo, HASHES[:4], [list(range(10, 20))], 64, (64,))
    assert [c.span_index for c in loads] == [3]
    # One token wider, and block 2 is needed again.
    wide = Geometry.of(Layout("M", (GroupSpec(Kind.SLIDING_WINDOW, 16, 18),), hash_block_size=16))
    assert compute_hit(wide, 70, stored).hit_tokens == 0
