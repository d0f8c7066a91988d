"""Layout validation and the `--groups` syntax: bad layouts raise InvalidLayout with the reason."""

import re

import pytest

from kvsidecar_contract.placement import GroupSpec, InvalidLayout, Kind, Layout, Parallel, parse_group, parse_groups


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mla", GroupSpec(Kind.MLA, 16)),
        ("full_attention/32", GroupSpec(Kind.FULL_ATTENTION, 32)),
        ("sliding_window:4096", GroupSpec(Kind.SLIDING_WINDOW, 16, 4096)),
        ("sliding_window_mla:128/64", GroupSpec(Kind.SLIDING_WINDOW_MLA, 64, 128)),
        ("mamba/64", GroupSpec(Kind.MAMBA, 64)),
        ("uniform(mla+full_attention)", GroupSpec(Kind.UNIFORM, 16, 0, (Kind.MLA, Kind.FULL_ATTENTION))),
        (
            "uniform(sliding_window:512+full_attention)/32",
            GroupSpec(Kind.UNIFORM, 32, 512, (Kind.SLIDING_WINDOW, Kind.FULL_ATTENTION)),
        ),
    ],
)
def test_parse_group(text, expected):
    assert parse_group(text, 16) == expected


def test_parse_groups_round_trips_describe():
    groups = parse_groups("mla,mamba,sliding_window:128,uniform(mla+full_attention)", 16)
    assert [g.describe() for g in groups] == [
        "mla",
        "mamba",
        "sliding_window:128",
        "uniform(mla+full_attention)",
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("attention", "unknown group kind 'attention'"),
        ("mla:16", "only sliding-window kinds take a window"),
        ("sliding_window", "needs window >= 1"),
        ("sliding_window:abc", "window in"),
        ("uniform()", "unknown group kind ''"),
        ("uniform(uniform(mla))", "unknown group kind"),
        ("uniform", "uniform(kind+kind)"),
        ("mla/0", "block_size must be in [1, 16777216]"),
        ("mla/16777217", "block_size must be in [1, 16777216]"),
        ("mla/x", "block size in"),
    ],
)
def test_bad_groups(text, reason):
    with pytest.raises(InvalidLayout, match=re.escape(reason)):
        parse_groups(text, 16)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"tp_size": 0}, r"tp_size must be in \[1, 1024\]"),
        ({"tp_size": 1025}, r"tp_size must be in \[1, 1024\]"),
        ({"pp_size": 257}, r"pp_size must be in \[1, 256\]"),
        ({"tp_size": 2, "tp_rank": 2}, r"tp_rank must be in \[0, 2\)"),
        ({"tp_rank": -1}, "tp_rank must be in"),
        ({"pp_size": 2, "pp_rank": 5}, "pp_rank must be in"),
        ({"pcp_size": 0}, r"pcp_size must be in \[1, 256\]"),
        ({"pcp_size": 2, "pcp_rank": 2}, "pcp_rank must be in"),
        ({"dcp_size": 0}, "dcp_size must be >= 1"),
        ({"tp_size": 4, "dcp_size": 3}, "dcp_size 3 must divide tp_size 4"),
        ({"tp_size": 2, "pcp_size": 2, "dcp_size": 2 * 2 + 2}, r"dcp_size must be 1, pcp_size or tp_size \* pcp"),
        ({"tp_size": 4, "pcp_size": 2, "dcp_size": 4}, r"\(\[1, 2, 8\]\), got 4"),
        ({"tp_size": 4, "tp_rank": 3, "dcp_size": 2, "dcp_rank": 0}, "vLLM's parallel state gives 1"),
        ({"tp_size": 2, "pcp_size": 2, "pcp_rank": 1, "dcp_size": 2, "dcp_rank": 0}, "gives 1"),
    ],
)
def test_bad_parallel(kwargs, reason):
    with pytest.raises(InvalidLayout, match=reason):
        Parallel(**kwargs)


MLA = (GroupSpec(Kind.MLA, 16),)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"model": ""}, "has no last path component"),
        ({"model": "/"}, "has no last path component"),
        ({"model": "a@b"}, "must not contain '@'"),
        ({"cache_prefix": "x@y"}, "cache_prefix must not contain '@'"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"hash_block_size": 0}, r"hash_block_size must be in \[1, 16777216\]"),
        ({"groups": ()}, "at least one KV-cache group"),
        (
            {"groups": (GroupSpec(Kind.MLA, 24),)},
            r"spans 24 tokens \(block_size 24\), not a multiple of hash_block_size 16",
        ),
        (
            {
                "groups": (GroupSpec(Kind.FULL_ATTENTION, 16),),
                "num_kv_heads": 3,
                "parallel": Parallel(tp_size=2),
            },
            "num_kv_heads 3 and tp_size 2 must divide one another",
        ),
    ],
)
def test_bad_layout(kwargs, reason):
    args = {"model": "m", "groups": MLA, **kwargs}
    with pytest.raises(InvalidLayout, match=reason):
        Layout(**args)


def test_heads_need_not_divide_tp_without_gqa_groups():
    Layout("m", (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16)), Parallel(tp_size=4), num_kv_heads=3)


def test_invalid_layout_is_a_value_error():
    assert issubclass(InvalidLayout, ValueError)


def test_spans_not_block_sizes_must_align_with_u():
    # vLLM under DCP hashes every block_size * D tokens: attention blocks of 16 tokens at D=4 span 64.
    par = Parallel(tp_size=4, dcp_size=4)
    Layout("m", (GroupSpec(Kind.FULL_ATTENTION, 16),), par, num_kv_heads=4, hash_block_size=64)
    with pytest.raises(InvalidLayout, match="group 1 \\(mamba\\): a block spans 16 tokens"):
        Layout("m", (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16)), par, 4, 64)


def test_absurd_layouts_are_refused_before_any_work():
    from kvsidecar_contract.placement import Geometry

    # 1024 ranks x 256 stages x 2 groups of one namespace per rank: 2^19 namespaces.
    big = Layout("m", (GroupSpec(Kind.MAMBA, 16),) * 2, Parallel(tp_size=1024, pp_size=256), num_kv_heads=1)
    with pytest.raises(InvalidLayout, match="key namespaces per boundary"):
        Geometry.of(big)
    # Spans whose least common multiple passes 2^31 tokens.
    odd = (GroupSpec(Kind.FULL_ATTENTION, 65521 * 16), GroupSpec(Kind.FULL_ATTENTION, 65519 * 16))
    with pytest.raises(InvalidLayout, match="least common multiple"):
        Geometry.of(Layout("m", odd, num_kv_heads=1, hash_block_size=16))


# (T, C, D, r, c) -> d, by hand from vLLM's initialize_model_parallel: ranks are laid out PP x PCP x TP, and the DCP
# groups are cut from the (TP, PCP) plane with PCP varying fastest.
DCP_RANKS = [
    ((8, 1, 4, 6, 0), 2),  # no PCP: r mod D
    ((2, 2, 4, 1, 0), 2),  # D = T * C: r * C + c
    ((2, 2, 4, 1, 1), 3),
    ((1, 2, 2, 0, 1), 1),  # D = C: the PCP rank
    ((4, 2, 2, 3, 0), 0),
    ((4, 2, 8, 2, 1), 5),
    ((4, 2, 1, 3, 1), 0),  # no DCP
]


@pytest.mark.parametrize(("sizes", "d"), DCP_RANKS)
def test_dcp_rank_as_vllm_lays_it_out(sizes, d):
    t, c, dcp, r, pc = sizes
    assert Parallel(tp_size=t, tp_rank=r, pcp_size=c, pcp_rank=pc, dcp_size=dcp).dcp_rank == d
    # The rank the engine reads from its parallel state is accepted when it agrees.
    assert Parallel(tp_size=t, tp_rank=r, pcp_size=c, pcp_rank=pc, dcp_size=dcp, dcp_rank=d).dcp_rank == d


def test_every_dcp_size_vllm_accepts_and_no_other():
    for t, c in ((t, c) for t in range(1, 9) for c in (1, 2)):
        accepted = {d for d in range(1, 2 * t * c + 1) if _accepts(t, c, d)}
        assert accepted == ({d for d in range(1, t + 1) if t % d == 0} if c == 1 else {1, c, t * c}), (t, c)


def _accepts(t: int, c: int, d: int) -> bool:
    try:
        Parallel(tp_size=t, pcp_size=c, dcp_size=d)
    except InvalidLayout:
        return False
    return True


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"hit_alignment_tokens": 24}, "hit_alignment_tokens 24 must be a multiple of hash_block_size 16"),
        ({"hit_alignment_tokens": 32, "fine_grained_hits": True}, "must be hash_block_size 16, got 32"),
    ],
)
def test_bad_hit_alignment(kwargs, reason):
    with pytest.raises(InvalidLayout, match=reason):
        Layout("M", MLA, hash_block_size=16, **kwargs)
