"""The key-free rules both sides share: which span indices a Load writes and which values a Save stores."""

import pytest

from kvsidecar_contract.placement import (
    GroupSpec,
    Kind,
    Layout,
    Parallel,
    Spans,
    load_spans,
    parse_group,
    save_spans,
)


@pytest.mark.parametrize(
    ("group", "hit", "start", "expected"),
    [
        ("full_attention", 64, 0, range(0, 4)),
        ("full_attention", 64, 16, range(1, 4)),
        ("full_attention", 64, 64, range(0)),
        ("full_attention", 56, 0, range(0, 4)),  # the block holding the hit end, read under its tail
        ("sliding_window:32", 64, 0, range(2, 4)),
        ("mamba", 64, 0, range(3, 4)),
        ("mamba", 64, 48, range(3, 4)),
        # A packed value with an attention member needs the attention's blocks, recurrent member or not.
        ("uniform(mla+mamba)", 64, 0, range(0, 4)),
        ("uniform(sliding_window:32+mamba)", 64, 0, range(2, 4)),
        ("uniform(sliding_window:32+full_attention)", 64, 0, range(0, 4)),  # the full member needs them all
    ],
)
def test_load_spans(group, hit, start, expected):
    assert load_spans(parse_group(group, 16), 16, hit, start) == expected


@pytest.mark.parametrize(
    ("group", "mid", "num_tokens", "saved", "expected"),
    [
        ("full_attention", False, 40, 0, [(0, 16), (1, 32)]),
        ("full_attention", True, 44, 0, [(0, 16), (1, 32), (2, 40)]),  # U = 8: the partial block under 40
        ("full_attention", False, 48, 16, [(1, 32), (2, 48)]),
        ("mamba", True, 44, 0, [(0, 16), (1, 32), (2, 40)]),
        ("mamba", True, 44, 32, [(2, 40)]),
        ("mamba", True, 44, 40, []),
        ("mamba", False, 48, 32, [(2, 48)]),
        # No partial state where no hit can end inside a block (e.g. next to a sliding window on longer blocks,
        # where vLLM aligns hits to the spans' lcm): no lookup would ever read it.
        ("mamba", False, 44, 0, [(0, 16), (1, 32)]),
    ],
)
def test_save_spans(group, mid, num_tokens, saved, expected):
    assert save_spans(parse_group(group, 16), 16, 8, mid, num_tokens, saved) == expected


def test_save_spans_skip_exactly_the_boundaries_already_saved():
    for text in ("full_attention", "mamba", "uniform(mla+mamba)"):
        group = parse_group(text, 32)
        for fine in (False, True):
            for num in range(0, 200, 8):
                every = save_spans(group, 32, 8, fine, num)
                for saved in range(num + 1):
                    assert save_spans(group, 32, 8, fine, num, saved) == [(k, b) for k, b in every if b > saved]


def test_spans_of_a_layout():
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 64))
    spans = Spans.of(Layout("m", groups, Parallel(tp_size=2, dcp_size=2)))
    assert (spans.spans, spans.fine_grained, spans.unit) == ((32, 64), True, 16)
    coarse = Spans.of(Layout("m", (GroupSpec(Kind.FULL_ATTENTION, 32), GroupSpec(Kind.MLA, 48))))
    assert (coarse.spans, coarse.fine_grained, coarse.unit) == ((32, 48), False, 96)
    assert coarse.load(96, 32) == [range(1, 3), range(0, 2)]
    assert coarse.save(96, 48) == [[(1, 64), (2, 96)], [(1, 96)]]
    # A sliding window on 32-token blocks: vLLM turns fine-grained hits off and aligns to the lcm, so the Mamba
    # group stores no partial state; the engine's own alignment (covering groups the store never sees) wins.
    sw = (GroupSpec(Kind.SLIDING_WINDOW, 32, 32), GroupSpec(Kind.MAMBA, 64))
    assert (Spans.of(Layout("m", sw)).fine_grained, Spans.of(Layout("m", sw)).unit) == (False, 64)
    assert Spans.of(Layout("m", sw)).save(120) == [[(0, 32), (1, 64), (2, 96)], [(0, 64)]]
    assert Spans.of(Layout("m", sw, hit_alignment_tokens=128)).unit == 128
    # W = 17 on 16-token blocks: a hit of 64 needs the 16 tokens before it, in block 3 only.
    assert load_spans(GroupSpec(Kind.SLIDING_WINDOW, 16, 17), 16, 64) == range(3, 4)


def test_every_proto_group_kind_is_a_placement_kind():
    from kvsidecar_contract.kinds import KIND_OF_PROTO, PROTO_OF_KIND
    from kvsidecar_contract.proto import sidecar_pb2 as pb

    named = {v.number for v in pb.GroupKind.DESCRIPTOR.values if v.number != pb.GROUP_KIND_UNSPECIFIED}
    assert set(KIND_OF_PROTO) == named and set(PROTO_OF_KIND) == set(Kind)
    assert all(pb.GroupKind.Name(PROTO_OF_KIND[k]) == k.name for k in Kind)
