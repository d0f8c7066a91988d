"""End to end: a real master, a real daemon process, and one OS process per engine rank with the real client.

Every scenario runs a cold pass (every rank fills its regions with what it truly holds, per `kvsidecar_testing.oracle`,
and saves), clears every region with a poison byte, then a warm pass (a scheduler session looks up, every rank
loads into other block ids) and checks every block of every region of every rank byte for byte against the oracle.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvsidecar.store import StoreCode
from kvsidecar_client import Hit
from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, Parallel, block_key
from kvsidecar_testing.oracle import Prompt
from support.e2e_engine import (
    GQA,
    MAMBA_CONV,
    MAMBA_SSM,
    MLA,
    cold_pass,
    delta,
    placements_match_oracle,
    saved_blocks,
    unique_model,
    warm_pass,
    writes,
)

pytestmark = pytest.mark.integration


# --- seed 000: TP-sharded Mamba state is never shared across ranks ------------------------------------------------


def test_tp2_mla_mamba_every_rank_gets_its_own_state_back(engines, schedulers, e2e_daemon):
    layout = Layout(unique_model("seed000"), (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16)), Parallel(2))
    engine = engines(layout, [MLA, MAMBA_CONV, MAMBA_SSM])
    placements_match_oracle(engine)
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 65, 16)  # 4 blocks per group; a full hit is 64
    assert sched.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 0

    before = saved_blocks(e2e_daemon)
    results = cold_pass(engine, prompt)
    # MLA: 4 values shared by the 2 ranks (2 each); Mamba: 4 values written by each rank into its own namespace.
    assert writes(results) == engine.expected_writes([4, 4]) == [(6, 2), (6, 2)]
    assert [r["skipped"] for r in results] == [0, 0]
    assert delta(saved_blocks(e2e_daemon), before) == {"mla": 4, "mamba": 8}  # every Mamba value, on both ranks

    hit = sched.lookup(prompt.hashes, prompt.num_tokens)
    assert (hit.hit_tokens, hit.tail_boundaries, hit.degraded) == (64, (64, 64), False)
    warm_pass(engine, prompt, hit)
    # The oracle gives each rank its own state: the two ranks' loaded Mamba blocks differ, their latents do not.
    digests = engine.digests()
    top = engine.warm_ids(prompt)[1][3]
    assert digests[0][1][top] != digests[1][1][top] and digests[0][2][top] != digests[1][2][top]
    assert digests[0][0] == digests[1][0]


def test_missing_mamba_shard_rejects_its_boundary(
    engines, schedulers, connect_mooncake, mooncake_settings, mooncake_master
):
    layout = Layout(unique_model("shard-gone"), (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16)), Parallel(2))
    engine = engines(layout, [MLA, MAMBA_CONV, MAMBA_SSM])
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 65, 16)
    cold_pass(engine, prompt)
    assert sched.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 64

    # Rank 1's Mamba state at 64, under the exact key its save used.
    geo = Geometry.of(layout.for_rank(1))
    key = block_key(geo.groups[1].prefix, prompt.hashes[64 // 16 - 1])
    assert key == f"kvs1@@{layout.model_key}@s1.c0.d0.p0.g1@{prompt.hashes[3].hex()}"
    store = connect_mooncake(mooncake_settings(mooncake_master))
    assert store.remove([key]) == [StoreCode.OK]

    hit = sched.lookup(prompt.hashes, prompt.num_tokens)
    assert (hit.hit_tokens, hit.tail_boundaries) == (48, (48, 48))  # rank 0's shard alone does not make 64
    warm_pass(engine, prompt, hit)


# --- worked example A: per-group replication, each replicated value written once per replication set -------------


def test_tp4_h2_mla_gqa_mamba_each_value_written_once_per_replication_set(engines, schedulers, e2e_daemon):
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    layout = Layout(unique_model("example-a"), groups, Parallel(4), num_kv_heads=2)
    tensors = [MLA, GQA, dataclasses.replace(MAMBA_CONV, group=2), dataclasses.replace(MAMBA_SSM, group=2)]
    engine = engines(layout, tensors)
    placements_match_oracle(engine)
    assert [len(engine.replication_sets(g)) for g in range(3)] == [1, 2, 4]
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 129, 16)  # 8 values per group per namespace

    before = saved_blocks(e2e_daemon)
    results = cold_pass(engine, prompt)
    # Per rank: MLA 8/4 + GQA 8/2 + Mamba 8 = 14 written, 6 + 4 + 0 = 10 left to the others.
    assert writes(results) == engine.expected_writes([8, 8, 8]) == [(14, 10)] * 4
    # Across ranks: once per replication set: 1 x 8 latents, 2 x 8 GQA values, 4 x 8 states.
    assert delta(saved_blocks(e2e_daemon), before) == {"mla": 8, "full_attention": 16, "mamba": 32}

    hit = sched.lookup(prompt.hashes, prompt.num_tokens)
    assert (hit.hit_tokens, hit.tail_boundaries) == (128, (128, 128, 128))
    warm_pass(engine, prompt, hit)
    digests = engine.digests()
    assert digests[0][0] == digests[1][0] == digests[2][0] == digests[3][0]  # latents: identical on all ranks
    assert digests[0][1] == digests[1][1] and digests[2][1] == digests[3][1]  # GQA: by KV head
    assert digests[0][1] != digests[2][1]
    assert len({tuple(d[2]) for d in digests}) == 4  # Mamba: by rank


# --- seed 002 scaled down: DCP=4 hybrid with fine-grained hits, EAGLE, tails that are not the hit length ----------


DCP_GROUPS = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 32))


@pytest.mark.parametrize(
    ("num_tokens", "hit_tokens", "tails", "writes_per_group"),
    [
        # Attention spans 64 (16 x D), Mamba 32, U 16. 200 tokens: attention blocks end at 64, 128, 192; states
        # at 32..192. Attention reaches 192, EAGLE gives back 16 -> 176, Mamba has no state at 176 and lowers to 160;
        # attention serves 160 from block [128, 192), stored under 192 (seed 002's shape).
        (200, 160, (192, 192, 160), (3, 3, 6)),
        # 180 tokens: the partial block [128, 192) is stored under 176, the last complete unit; states at 32..160
        # and 176. Attention reaches 176, EAGLE -> 160, Mamba serves 160; the tail is 176.
        (180, 160, (176, 176, 160), (3, 3, 6)),
    ],
)
def test_dcp4_hybrid_loads_read_the_tail_boundaries(
    engines, schedulers, num_tokens, hit_tokens, tails, writes_per_group
):
    layout = Layout(unique_model(f"seed002-{num_tokens}"), DCP_GROUPS, Parallel(4, dcp_size=4), num_kv_heads=4)
    tensors = [MLA, GQA, dataclasses.replace(MAMBA_CONV, group=2), dataclasses.replace(MAMBA_SSM, group=2)]
    engine = engines(layout, tensors)
    placements_match_oracle(engine)
    sched = schedulers(layout)
    assert sched.session_info is not None and sched.session_info.fine_grained_hits
    prompt = Prompt(layout.model, num_tokens, 16)

    results = cold_pass(engine, prompt)
    assert writes(results) == engine.expected_writes(writes_per_group) == [(12, 0)] * 4  # D > 1: every rank, all

    hit = sched.lookup(prompt.hashes, prompt.num_tokens, eagle=True)
    assert (hit.hit_tokens, hit.tail_boundaries, hit.degraded) == (hit_tokens, tails, False)
    assert hit.tail_boundaries[0] != hit.hit_tokens and hit.tail_boundaries[1] != hit.hit_tokens

    # The bug of seed 002: a tail key derived from the hit length was never stored (-704 at load time).
    engine.clear()
    derived = Hit(hit.hit_tokens, (hit.hit_tokens,) * 3)
    failed = engine.load(prompt, derived)
    last = (hit_tokens - 1) // 64
    ids = engine.warm_ids(prompt)
    derived_failures = [[0, ids[0][last], "not_found"], [1, ids[1][last], "not_found"]]
    assert [sorted([f["group"], f["block_id"], f["reason"]] for f in r["failures"]) for r in failed] == [
        derived_failures
    ] * 4

    warm_pass(engine, prompt, hit)  # the lookup's own tails: every block loads, with the right bytes


def test_dcp4_hybrid_any_prompt_length_loads_the_right_bytes(engines, schedulers):
    """Many prompt lengths, and shorter prompts sharing their prefix, with and without EAGLE: no failed load."""
    layout = Layout(unique_model("dcp-lengths"), DCP_GROUPS, Parallel(4, dcp_size=4), num_kv_heads=4)
    tensors = [MLA, GQA, dataclasses.replace(MAMBA_CONV, group=2), dataclasses.replace(MAMBA_SSM, group=2)]
    engine = engines(layout, tensors)
    sched = schedulers(layout)
    mid_block_tails = 0
    for length in (33, 97, 150, 211, 250):
        stored = Prompt(f"{layout.model}/{length}", length, 16)
        cold_pass(engine, stored)
        for asked in sorted({n for n in (length, length - 20, length - 45, length // 2) if n > 0}):
            prompt = stored._replace(num_tokens=asked)  # the same tokens, cut shorter: a shared prefix
            for eagle in (False, True):
                hit = sched.lookup(prompt.hashes, prompt.num_tokens, eagle=eagle)
                assert not hit.degraded
                mid_block_tails += hit.tail_boundaries[0] != hit.hit_tokens
                engine.clear()
                loads = engine.load(prompt, hit)
                expected = engine.expected_loaded(stored, hit.hit_tokens)
                assert [(r["loaded"], r["failures"]) for r in loads] == [(expected, [])] * 4, (asked, eagle, hit)
                assert engine.verify(stored, hit.hit_tokens) == [], (asked, eagle, hit)
    assert mid_block_tails >= 5  # the interesting case happened, not only block-aligned hits


# --- PP=2, and two tenants on one model ----------------------------------------------------------------------------


def test_pp2_tenants_never_share_a_hit(engines, schedulers):
    model = unique_model("tenants")
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16))
    layout_a = Layout(model, groups, Parallel(2, pp_size=2), cache_prefix=f"tenant-a-{uuid.uuid4().hex[:6]}")
    layout_b = dataclasses.replace(layout_a, cache_prefix=f"tenant-b-{uuid.uuid4().hex[:6]}")
    a = engines(layout_a, [MLA, MAMBA_CONV, MAMBA_SSM])
    b = engines(layout_b, [MLA, MAMBA_CONV, MAMBA_SSM])
    placements_match_oracle(a)
    sched_a, sched_b = schedulers(layout_a), schedulers(layout_b)
    prompt = Prompt(f"{model}/same-prompt", 65, 16)  # the same prompt, token for token, for both tenants
    stage0 = [i for i, r in enumerate(a.ranks) if r.pp == 0]
    stage1 = [i for i, r in enumerate(a.ranks) if r.pp == 1]

    a.prefill(prompt)
    first = a.save(prompt, stage0)
    assert sched_a.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 0  # stage 1's layers are not stored yet
    second = a.save(prompt, stage1)
    assert writes(first + second) == [a.expected_writes([4, 4])[i] for i in stage0 + stage1]
    assert sched_a.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 64

    assert sched_b.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 0  # no cross-tenant hit
    results = cold_pass(b, prompt)
    assert [r["skipped"] for r in results] == [0] * 4  # tenant B stored its own copy, found nothing of A's
    assert writes(results) == b.expected_writes([4, 4])

    for engine, sched in ((a, sched_a), (b, sched_b)):
        hit = sched.lookup(prompt.hashes, prompt.num_tokens)
        assert (hit.hit_tokens, hit.tail_boundaries) == (64, (64, 64))
        warm_pass(engine, prompt, hit)
