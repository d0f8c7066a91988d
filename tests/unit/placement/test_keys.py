"""Exact key strings (rule 3): byte-compatible with vLLM's in-tree Mooncake store connector."""

import pytest

from kvsidecar_contract.placement import (
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
        (("Model", "", 0, 0, 0, 0, 0), "Model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"),
        (("Model", "tenant-a", 3, 1, 2, 1, 4), "tenant-a@Model@tp_rank:3@pcp1@dcp2@pp_rank:1@group:4"),
        (("m", "salt:x/y", 15, 0, 7, 3, 12), "salt:x/y@m@tp_rank:15@pcp0@dcp7@pp_rank:3@group:12"),
    ],
)
def test_namespace_prefix_fields(args, expected):
    assert namespace_prefix(*args) == expected


@pytest.mark.parametrize(
    ("model", "cache_prefix", "expected"),
    [
        ("Model", "", "Model@"),
        ("org/Model/", "", "Model@"),  # a model name or its key: the key field is the last path component
        ("Model", "tenant-a", "tenant-a@Model@"),
        ("deepseek-ai/DeepSeek-V3", "salt:x/y", "salt:x/y@DeepSeek-V3@"),
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
    prefix = "Model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
    assert block_key(prefix, H_AB) == prefix + "@" + "ab" * 31 + "0f"
    assert block_key(prefix, b"\x00\xff") == prefix + "@00ff"


def test_model_field_is_last_path_component():
    layout = Layout("deepseek-ai/DeepSeek-V3/", (GroupSpec(Kind.MLA, 16),))
    geo = Geometry.of(layout)
    assert geo.groups[0].prefix == "DeepSeek-V3@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"


def test_saved_key_without_and_with_cache_prefix():
    par = Parallel(tp_size=4, tp_rank=3, pp_size=2, pp_rank=1, pcp_size=2, pcp_rank=1)
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16),)
    for cache_prefix, head in (("", ""), ("cache-salt-7", "cache-salt-7@")):
        geo = Geometry.of(Layout("org/Llama", groups, par, num_kv_heads=2, cache_prefix=cache_prefix))
        # factor T//H = 2, shard 3 // 2 = 1; chunk 0 of group 0 is written by ranks with (r + 0) % 2 == 0,
        # so rank 3 writes chunk 1.
        plan = save_plan(geo, [H00, H_AB], [[5, 6]], 32)
        assert [c.key for c in plan.chunks] == [f"{head}Llama@tp_rank:1@pcp1@dcp0@pp_rank:1@group:0@{H_AB.hex()}"]
        assert plan.others == 1


def test_dcp_key_names_the_heads_and_the_dcp_slice():
    # Under DCP a rank holds its heads of its slice of the sequence. The MLA latent has one "head" on every rank,
    # so ranks 2 and 6 (both DCP rank 2 of 4) hold the same bytes and share tp_rank:0; Mamba state is per rank.
    # (This key was tp_rank:6 while every group had factor 1 under DCP, writing each latent T/D times.)
    par = Parallel(tp_size=8, tp_rank=6, dcp_size=4)
    geo = Geometry.of(Layout("M", (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16)), par))
    assert [g.prefix for g in geo.groups] == [
        "M@tp_rank:0@pcp0@dcp2@pp_rank:0@group:0",
        "M@tp_rank:6@pcp0@dcp2@pp_rank:0@group:1",
    ]
    assert [g.factor for g in geo.groups] == [2, 1]


def test_lookup_keys_cover_every_namespace_in_order():
    par = Parallel(tp_size=2, pp_size=2, pcp_size=2)
    geo = Geometry.of(Layout("M", (GroupSpec(Kind.MAMBA, 16),), par, cache_prefix="t"))
    plan = lookup_plan(geo, [H00], 16)
    assert plan.keys == [
        f"t@M@tp_rank:{s}@pcp{c}@dcp0@pp_rank:{p}@group:0@{H00.hex()}" for c in (0, 1) for s in (0, 1) for p in (0, 1)
    ]
