"""Exact key strings (rule 3): `kvs1@<cache_prefix>@<model>~<value_id>@s<s>.c<c>.d<d>.p<p>.g<g>@<hash_hex>`.

The format changed on purpose (issue 13): values carry what they mean (the value id) and keys can never equal a key
of vLLM's in-tree Mooncake connector (tests/vllm_connector/test_intree_keys.py proves that against vLLM's own code).
"""

import re
from dataclasses import replace

import pytest

from kvsidecar_contract.placement import (
    KEY_TAIL_PATTERN,
    Geometry,
    GroupSpec,
    Kind,
    Layout,
    Parallel,
    block_key,
    key_prefix,
    lookup_plan,
    namespace_prefix,
    save_plan,
)

H00 = bytes(32)
H_AB = bytes.fromhex("ab" * 31 + "0f")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("Model~0a", "", 0, 0, 0, 0, 0), "kvs1@@Model~0a@s0.c0.d0.p0.g0"),
        (("Model~0a", "tenant-a", 3, 1, 2, 1, 4), "kvs1@tenant-a@Model~0a@s3.c1.d2.p1.g4"),
        (("m~ff", "salt:x/y", 15, 0, 7, 3, 12), "kvs1@salt:x/y@m~ff@s15.c0.d7.p3.g12"),
    ],
)
def test_namespace_prefix_fields(args, expected):
    with pytest.raises(ValueError, match="value id"):
        namespace_prefix("Model", "", 0, 0, 0, 0, 0)
    assert namespace_prefix(*args) == expected
    assert expected.startswith(key_prefix(args[0].rpartition("~")[0], args[1]))


@pytest.mark.parametrize(
    ("model", "cache_prefix", "expected"),
    [
        ("Model", "", "kvs1@@Model~"),
        ("org/Model/", "", "kvs1@@Model~"),  # a model name or its key: the key field is the last path component
        ("Model", "tenant-a", "kvs1@tenant-a@Model~"),
        ("deepseek-ai/DeepSeek-V3", "salt:x/y", "kvs1@salt:x/y@DeepSeek-V3~"),
    ],
)
def test_key_prefix_starts_every_key_of_a_model(model, cache_prefix, expected):
    assert key_prefix(model, cache_prefix) == expected
    layout = Layout(model, (GroupSpec(Kind.FULL_ATTENTION, 16),), Parallel(tp_size=2), 2, cache_prefix=cache_prefix)
    for rank in range(2):
        geo = Geometry.of(layout.for_rank(rank))
        prefixes = [g.prefix for g in geo.groups] + [p for g in geo.groups for p in g.lookup_prefixes]
        assert all(p.startswith(expected) for p in prefixes)


def test_block_key_is_lowercase_hex_of_the_hash():
    prefix = "kvs1@@Model~0a@s0.c0.d0.p0.g0"
    assert block_key(prefix, H_AB) == prefix + "@" + "ab" * 31 + "0f"
    assert block_key(prefix, b"\x00\xff") == prefix + "@00ff"


def test_model_field_is_last_path_component_and_the_value_id():
    layout = Layout("deepseek-ai/DeepSeek-V3/", (GroupSpec(Kind.MLA, 16),))
    geo = Geometry.of(layout)
    # Pinned: a change of this digest is a change of the value format and must be deliberate (bump VALUE_FORMAT).
    assert layout.value_id == "9b14d267e74cc1695b48b2cd"
    assert geo.groups[0].prefix == "kvs1@@DeepSeek-V3~9b14d267e74cc1695b48b2cd@s0.c0.d0.p0.g0"


def test_saved_key_without_and_with_cache_prefix():
    par = Parallel(tp_size=4, tp_rank=3, pp_size=2, pp_rank=1, pcp_size=2, pcp_rank=1)
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16),)
    for cache_prefix in ("", "cache-salt-7"):
        layout = Layout("org/Llama", groups, par, num_kv_heads=2, cache_prefix=cache_prefix)
        geo = Geometry.of(layout)
        # factor T//H = 2, shard 3 // 2 = 1; chunk 0 of group 0 is written by ranks with (r + 0) % 2 == 0,
        # so rank 3 writes chunk 1.
        plan = save_plan(geo, [H00, H_AB], [[5, 6]], 32)
        want = f"kvs1@{cache_prefix}@Llama~{layout.value_id}@s1.c1.d0.p1.g0@{H_AB.hex()}"
        assert [c.key for c in plan.chunks] == [want]
        assert plan.others == 1


def test_dcp_key_names_the_heads_and_the_dcp_slice():
    # Under DCP a rank holds its heads of its slice of the sequence. The MLA latent has one "head" on every rank,
    # so ranks 2 and 6 (both DCP rank 2 of 4) hold the same bytes and share tp_rank:0; Mamba state is per rank.
    # (This key was tp_rank:6 while every group had factor 1 under DCP, writing each latent T/D times.)
    par = Parallel(tp_size=8, tp_rank=6, dcp_size=4)
    layout = Layout("M", (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16)), par)
    geo = Geometry.of(layout)
    assert [g.prefix for g in geo.groups] == [
        f"kvs1@@M~{layout.value_id}@s0.c0.d2.p0.g0",
        f"kvs1@@M~{layout.value_id}@s6.c0.d2.p0.g1",
    ]
    assert [g.factor for g in geo.groups] == [2, 1]


def test_lookup_keys_cover_every_namespace_in_order():
    par = Parallel(tp_size=2, pp_size=2, pcp_size=2)
    layout = Layout("M", (GroupSpec(Kind.MAMBA, 16),), par, cache_prefix="t")
    plan = lookup_plan(Geometry.of(layout), [H00], 16)
    assert plan.keys == [
        f"kvs1@t@M~{layout.value_id}@s{s}.c{c}.d0.p{p}.g0@{H00.hex()}" for c in (0, 1) for s in (0, 1) for p in (0, 1)
    ]


BASE = Layout("org/M", (GroupSpec(Kind.FULL_ATTENTION, 16),), Parallel(tp_size=2), num_kv_heads=2)


@pytest.mark.parametrize(
    "other",
    [
        replace(BASE, value_identity="weights-b"),
        replace(BASE, groups=(GroupSpec(Kind.FULL_ATTENTION, 32),)),
        replace(BASE, groups=(GroupSpec(Kind.SLIDING_WINDOW, 16, 64),)),
        replace(BASE, num_kv_heads=4),
        replace(BASE, hash_block_size=8),
        replace(BASE, parallel=Parallel(tp_size=4)),
        replace(BASE, parallel=Parallel(tp_size=2, pp_size=2)),
        replace(BASE, parallel=Parallel(tp_size=2, pcp_size=2)),
        replace(BASE, parallel=Parallel(tp_size=2, dcp_size=2)),
    ],
    ids=["identity", "block-size", "kind", "heads", "hash-block", "tp", "pp", "pcp", "dcp"],
)
def test_what_shapes_a_value_changes_the_value_id(other):
    assert other.value_id != BASE.value_id
    assert other.model_key != BASE.model_key


def test_ranks_of_one_engine_share_the_value_id():
    assert {BASE.for_rank(r, 0, 0).value_id for r in range(2)} == {BASE.value_id}


def test_a_reset_matches_exactly_its_own_keys():
    tail = re.compile(KEY_TAIL_PATTERN)
    own = Geometry.of(BASE).groups[0].prefix + "@" + H00.hex()
    head = key_prefix(BASE.model, "")
    assert own.startswith(head) and tail.fullmatch(own, len(head))
    # The cache prefix is its own field even when empty: no tenant's prefix can stand for another's model.
    assert not own.startswith(key_prefix(BASE.model, "t"))
    # A model whose name continues this one's ("M~x" after "M") starts alike but never has the tail's shape.
    other = Geometry.of(Layout(f"org/M~{BASE.value_id}", BASE.groups, BASE.parallel, 2)).groups[0].prefix
    assert other.startswith(head) and not tail.fullmatch(other + "@" + H00.hex(), len(head))


def test_another_value_format_changes_every_value_id(monkeypatch):
    from kvsidecar_contract.placement import keys

    before = BASE.value_id
    monkeypatch.setattr(keys, "VALUE_FORMAT", keys.VALUE_FORMAT + 1)
    assert BASE.value_id != before
