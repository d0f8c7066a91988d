"""Save, load and lookup plans in detail: striping, partial tails, windows, resumption, bad requests."""

import pytest

from kvsidecar_contract.placement import (
    Geometry,
    GroupSpec,
    Hit,
    Kind,
    Layout,
    Parallel,
    RequestMismatch,
    check_hit,
    compute_hit,
    load_plan,
    lookup_plan,
    save_plan,
)

H = [i.to_bytes(32, "big") for i in range(1, 100)]


def geo_of(*groups, u=16, **par):
    return Geometry.of(Layout("M", tuple(groups), Parallel(**par), num_kv_heads=1, hash_block_size=u))


def test_striping_rotates_the_writer_with_the_group():
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MLA, 16))
    by_rank = {}
    for r in range(2):
        plan = save_plan(geo_of(*groups, tp_size=2, tp_rank=r), H, [list(range(4))] * 2, 64)
        by_rank[r] = [(c.group, c.span_index) for c in plan.chunks]
        assert plan.others == 4
    assert by_rank[0] == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert by_rank[1] == [(0, 1), (0, 3), (1, 0), (1, 2)]


def test_partial_block_saved_only_with_fine_grained_hits():
    coarse = geo_of(GroupSpec(Kind.FULL_ATTENTION, 32))
    plan = save_plan(coarse, H, [[7, 8, 9]], 80)
    assert [(c.span_index, c.boundary, c.block_id) for c in plan.chunks] == [(0, 32, 7), (1, 64, 8)]
    fine = geo_of(GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MAMBA, 64))
    plan = save_plan(fine, H, [[7, 8, 9], [1, 2]], 90)
    assert [(c.group, c.span_index, c.boundary, c.block_id) for c in plan.chunks] == [
        (0, 0, 32, 7),
        (0, 1, 64, 8),
        (0, 2, 80, 9),  # partial attention block under the last U boundary it holds
        (1, 0, 64, 1),
        (1, 1, 80, 2),  # recurrent state at the prompt's last U boundary
    ]
    assert plan.chunks[2].key.endswith(H[80 // 16 - 1].hex())


def test_sliding_window_loads_only_blocks_in_the_window():
    geo = geo_of(GroupSpec(Kind.SLIDING_WINDOW, 16, 32), GroupSpec(Kind.FULL_ATTENTION, 16))
    chunks = load_plan(geo, H, [list(range(10)), list(range(10, 20))], 96, (96, 96))
    assert [(c.group, c.span_index) for c in chunks if c.group == 0] == [(0, 4), (0, 5)]
    assert [c.span_index for c in chunks if c.group == 1] == [0, 1, 2, 3, 4, 5]
    # A window that does not start on a block boundary needs the block it starts in.
    geo = geo_of(GroupSpec(Kind.SLIDING_WINDOW, 16, 24))
    assert [c.span_index for c in load_plan(geo, H, [list(range(10))], 96, (96,))] == [4, 5]


def test_sliding_window_hit_needs_only_the_window():
    geo = geo_of(GroupSpec(Kind.SLIDING_WINDOW, 16, 32))
    row = [False, False, False, False, True, True, False]
    assert compute_hit(geo, 7 * 16 + 1, [row]) == Hit(96, (96,))


def test_load_skips_blocks_the_engine_already_has():
    geo = geo_of(GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 32))
    chunks = load_plan(geo, H, [list(range(8)), list(range(4))], 96, (96, 96), start_tokens=48)
    assert [(c.group, c.span_index) for c in chunks] == [(0, 3), (0, 4), (0, 5), (1, 2)]
    assert load_plan(geo, H, [list(range(8)), list(range(4))], 96, (96, 96), start_tokens=96) == ()


def test_recurrent_load_reads_only_the_state_at_the_hit():
    geo = geo_of(GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 64))
    chunks = load_plan(geo, H, [list(range(8)), [40, 41]], 80, (80, 80))
    assert [(c.group, c.span_index, c.boundary, c.block_id) for c in chunks if c.group == 1] == [(1, 1, 80, 41)]


def test_lookup_probes_block_ends_only_without_fine_grained_hits():
    geo = geo_of(GroupSpec(Kind.FULL_ATTENTION, 32))
    plan = lookup_plan(geo, H[:5], 80)
    assert [k.rsplit("@", 1)[1] for k in plan.keys] == [H[1].hex(), H[3].hex()]
    fine = geo_of(GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MAMBA, 64))
    assert len(lookup_plan(fine, H[:5], 80).keys) == 10


def test_unknown_probe_results_count_as_missing():
    geo = geo_of(GroupSpec(Kind.MLA, 16))
    plan = lookup_plan(geo, H[:3], 48)
    assert plan.stored([True, False, True]) == [[True, False, True]]
    with pytest.raises(RequestMismatch, match="expected 3 probe results"):
        plan.stored([True])


@pytest.mark.parametrize(
    ("hit", "tails", "reason"),
    [
        (32, (32,), "expected 2 tail boundaries"),
        (40, (48, 48), "not a non-negative multiple of 16"),
        (-16, (0, 0), "not a non-negative multiple"),
        (112, (112, 112), "exceeds the 6 block hashes"),
        (0, (16, 0), "must be 0 for a zero-token hit"),
        (48, (48, 64), "tail boundary must be the hit end 48"),  # recurrent: exactly the hit
        (48, (80, 48), r"multiple of 16 in \[48, 64\]"),  # attention tail past its block
        (48, (40, 48), r"multiple of 16 in \[48, 64\]"),
        (64, (48, 64), "tail boundary must be the hit end 64"),  # hit at a block end
    ],
)
def test_check_hit_rejects_impossible_answers(hit, tails, reason):
    geo = geo_of(GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MAMBA, 64))
    with pytest.raises(RequestMismatch, match=reason):
        check_hit(geo, 6, hit, tails)


def test_bad_save_and_load_requests():
    geo = geo_of(GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    with pytest.raises(RequestMismatch, match="expected block ids for 2 groups"):
        save_plan(geo, H, [[1]], 16)
    with pytest.raises(RequestMismatch, match="need 4 block hashes"):
        save_plan(geo, H[:2], [[1, 2, 3, 4]] * 2, 64)
    with pytest.raises(
        RequestMismatch, match=r"group 0 \(full_attention\) needs a block id for span 2, got 2 block ids"
    ):
        save_plan(geo, H, [[1, 2], [1, 2, 3, 4]], 64)
    with pytest.raises(RequestMismatch, match="saved_tokens 80"):
        save_plan(geo, H, [[1] * 4] * 2, 64, saved_tokens=80)
    with pytest.raises(RequestMismatch, match="start_tokens 64"):
        load_plan(geo, H, [[1] * 4] * 2, 48, (48, 48), start_tokens=64)
    with pytest.raises(RequestMismatch, match="more than num_tokens"):
        lookup_plan(geo, H[:5], 64)
    with pytest.raises(RequestMismatch, match="num_tokens must be >= 0"):
        lookup_plan(geo, [], -1)


def test_no_block_spans_are_skipped_by_saves_and_kept_by_loads():
    from kvsidecar_contract.placement import NO_BLOCK

    geo = geo_of(GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    # vLLM keeps Mamba state only where a step ended: null blocks elsewhere.
    plan = save_plan(geo, H, [[0, 1, 2, 3], [NO_BLOCK, 5, NO_BLOCK, 7]], 64)
    assert [(c.group, c.span_index, c.block_id) for c in plan.chunks] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (0, 3, 3),
        (1, 1, 5),
        (1, 3, 7),
    ]
    assert (plan.others, plan.absent) == (0, 2)
    chunks = load_plan(geo, H, [[0, 1, 2, 3], [NO_BLOCK] * 4], 64, (64, 64))
    assert chunks[-1].block_id == NO_BLOCK  # the load must say it failed, not silently skip it
    # A load that says it carries group 0 only is not about the state: it is left out, whatever its ids say.
    assert load_plan(geo, H, [[0, 1, 2, 3], []], 64, (64, 64), carried=[0]) == chunks[:4]
    assert [c.group for c in load_plan(geo, H, [[], [NO_BLOCK] * 3 + [7]], 64, (64, 64), carried=[1])] == [1]
    for carried in ([2], [0, 0]):
        with pytest.raises(RequestMismatch, match="must name each of the 2 groups at most once"):
            load_plan(geo, H, [[0, 1, 2, 3], []], 64, (64, 64), carried=carried)


def test_a_lookup_too_large_to_probe_is_refused():
    from kvsidecar_contract.placement.lookup import MAX_PROBE_KEYS

    geo = geo_of(GroupSpec(Kind.MAMBA, 1), u=1, tp_size=64)  # 64 namespaces per boundary
    n = MAX_PROBE_KEYS // 64 + 1
    with pytest.raises(RequestMismatch, match=r"would probe \d+ keys"):
        lookup_plan(geo, [b"h"] * n, n)
