"""End to end, the other paths an engine takes: chunked prefill, partial loads, uniform groups, PCP, sliding windows
under DCP, one tensor serving two groups, and a value lost between lookup and load.

Same harness as test_e2e_placement.py: one process per rank, the real client, bytes checked against the oracle.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvsidecar.store import StoreCode
from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, Parallel, block_key
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.oracle import POISON, Prompt, digest, pattern
from support.e2e_engine import (
    GQA,
    MAMBA_CONV,
    MAMBA_SSM,
    MLA,
    cold_pass,
    placements_match_oracle,
    unique_model,
    warm_pass,
    writes,
)

pytestmark = pytest.mark.integration

MLA_MAMBA = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 16))


def test_chunked_prefill_saves_resume_and_loads_skip_what_the_engine_holds(engines, schedulers):
    layout = Layout(unique_model("chunked"), MLA_MAMBA, Parallel(2))
    engine = engines(layout, [MLA, MAMBA_CONV, MAMBA_SSM])
    sched = schedulers(layout)
    full = Prompt(layout.model, 129, 16)
    engine.prefill(full)
    # Two scheduler steps: 64 tokens, then the rest; the second save skips boundaries <= 64 without asking the store.
    first = engine.save(full._replace(num_tokens=64))
    second = engine.save(full, saved_tokens=64)
    assert writes(first) == writes(second) == engine.expected_writes([4, 4]) == [(6, 2), (6, 2)]
    assert [r["skipped"] for r in second] == [0, 0]

    hit = sched.lookup(full.hashes, full.num_tokens)
    assert hit.hit_tokens == 128
    warm_pass(engine, full, hit)
    warm_pass(engine, full, hit, start_tokens=32)  # the engine already holds 32 tokens: blocks 0-1 stay untouched


def test_uniform_group_takes_the_factor_of_its_gqa_member(engines, schedulers):
    groups = (GroupSpec(Kind.UNIFORM, 16, inner=(Kind.MLA, Kind.FULL_ATTENTION)), GroupSpec(Kind.MAMBA, 16))
    layout = Layout(unique_model("uniform"), groups, Parallel(4), num_kv_heads=2)
    # The uniform group's value is its latent and its KV head, packed in registration order.
    engine = engines(layout, [MLA, dataclasses.replace(GQA, group=0), MAMBA_CONV, MAMBA_SSM])
    placements_match_oracle(engine)
    assert [len(engine.replication_sets(g)) for g in range(2)] == [2, 4]
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 129, 16)
    assert writes(cold_pass(engine, prompt)) == engine.expected_writes([8, 8]) == [(12, 4)] * 4
    warm_pass(engine, prompt, sched.lookup(prompt.hashes, prompt.num_tokens))


def test_pcp2_every_pcp_rank_keeps_its_own_values(engines, schedulers):
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    layout = Layout(unique_model("pcp"), groups, Parallel(2, pcp_size=2), num_kv_heads=1)
    engine = engines(layout, [dataclasses.replace(GQA, group=0), MAMBA_CONV, MAMBA_SSM])
    placements_match_oracle(engine)
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 129, 16)
    assert writes(cold_pass(engine, prompt)) == engine.expected_writes([8, 8]) == [(12, 4)] * 4
    hit = sched.lookup(prompt.hashes, prompt.num_tokens)
    assert hit.hit_tokens == 128
    warm_pass(engine, prompt, hit)


def test_sliding_window_under_dcp_with_eagle(engines, schedulers):
    groups = (GroupSpec(Kind.SLIDING_WINDOW, 16, window=48), GroupSpec(Kind.MLA, 16), GroupSpec(Kind.MAMBA, 32))
    layout = Layout(unique_model("swa-dcp"), groups, Parallel(2, dcp_size=2), num_kv_heads=2)
    tensors = [
        dataclasses.replace(GQA, group=0),
        dataclasses.replace(MLA, group=1),
        dataclasses.replace(MAMBA_CONV, group=2),
        dataclasses.replace(MAMBA_SSM, group=2),
    ]
    engine = engines(layout, tensors)
    placements_match_oracle(engine)
    sched = schedulers(layout)
    hits = []
    for length in (150, 190, 200):
        prompt = Prompt(f"{layout.model}/{length}", length, 16)
        cold_pass(engine, prompt)
        for eagle in (False, True):
            hit = sched.lookup(prompt.hashes, prompt.num_tokens, eagle=eagle)
            hits.append(hit.hit_tokens)
            warm_pass(engine, prompt, hit)  # the window's blocks only; the rest stays poison
    # Spans 32 (16 x D) and 32, U 16. vLLM's sliding-window manager cannot end a hit inside its block, so a window
    # longer than U turns fine-grained hits off and hits align to the spans' lcm, 32 (they were 16-aligned before,
    # [144, 128, 176, 160, 192, 160], ending inside a window block). EAGLE gives back one unit.
    assert hits == [128, 96, 160, 128, 192, 160]


def test_one_tensor_serving_two_groups_with_large_blocks(rank_procs, e2e_daemon):
    """vLLM's hybrid allocator lets groups share one tensor (disjoint block ids); 256 KiB blocks."""
    proc = rank_procs[0]
    model = unique_model("shared-tensor")
    spec = {
        "model": model,
        "layout": {"tp_size": 1, "tp_rank": 0},
        "num_kv_heads": 1,
        "hash_block_size": 16,
        "groups": [{"kind": "mla", "block_size": 16}, {"kind": "mamba", "block_size": 16}],
    }
    big = 256 << 10
    tensors = [
        {"shape": [32, 256, 512], "dtype": "bfloat16", "groups": [0, 1]},
        {"shape": [32, 64], "dtype": "uint8", "groups": [1]},
    ]
    proc.call("open", name="shared", address=e2e_daemon.target, spec=spec, tensors=tensors)
    try:
        hashes = [h.hex() for h in chained_hashes(model, 8)]
        cold = [list(range(8)), list(range(10, 18))]
        fill = [[0, b, f"{model}|{g}|{k}|t0"] for g in (0, 1) for k, b in enumerate(cold[g])]
        fill += [[1, b, f"{model}|1|{k}|t1"] for k, b in enumerate(cold[1])]
        proc.call("fill", name="shared", blocks=fill)
        saved = proc.call("save", name="shared", hashes=hashes, ids=cold, num_tokens=129)
        assert (saved["written"], saved["failed"], saved["bytes_written"]) == (16, 0, 8 * big + 8 * (big + 64))

        proc.call("poison", name="shared")
        hit = proc.call("lookup", name="shared", hashes=hashes, num_tokens=129)
        assert hit["hit_tokens"] == 128
        warm = [[31 - k for k in range(8)], [20, 21, 22, 23, 9, 8, 19, 18]]
        loaded = proc.call("load", name="shared", hashes=hashes, ids=warm, hit=hit)
        assert (loaded["loaded"], loaded["failures"]) == (9, [])  # 8 latent blocks + the state at 128

        want = [{warm[0][k]: f"{model}|0|{k}|t0" for k in range(8)}, {warm[1][7]: f"{model}|1|7|t1"}]
        want[0][warm[1][7]] = f"{model}|1|7|t0"
        found = proc.call("digests", name="shared")
        for t, size in ((0, big), (1, 64)):
            expected = [
                digest(pattern(want[t][b], size) if b in want[t] else bytes([POISON]) * size) for b in range(32)
            ]
            assert found[t] == expected, f"tensor {t}"
    finally:
        proc.call("close", name="shared")


def test_a_value_lost_between_lookup_and_load_is_named_and_the_rest_loads(
    engines, schedulers, connect_mooncake, mooncake_settings, mooncake_master
):
    layout = Layout(unique_model("lost"), MLA_MAMBA, Parallel(2))
    engine = engines(layout, [MLA, MAMBA_CONV, MAMBA_SSM])
    sched = schedulers(layout)
    prompt = Prompt(layout.model, 64, 16)
    cold_pass(engine, prompt)
    hit = sched.lookup(prompt.hashes, prompt.num_tokens)
    assert hit.hit_tokens == 48  # worked example D: a 64-token prompt recomputes its last token
    warm_pass(engine, prompt, hit)

    # The shared latent block [16, 32) disappears after the lookup (evicted, or removed by an operator).
    key = block_key(Geometry.of(layout.for_rank(0)).groups[0].prefix, prompt.hashes[1])
    assert connect_mooncake(mooncake_settings(mooncake_master)).remove([key]) == [StoreCode.OK]
    engine.clear()
    loads = engine.load(prompt, hit)
    lost = {"group": 0, "block_id": engine.warm_ids(prompt)[0][1], "reason": "not_found"}
    assert [(r["loaded"], r["failures"]) for r in loads] == [(3, [lost])] * 2  # blocks 0, 2 and the state
    problems = engine.verify(prompt, hit.hit_tokens)
    assert len(problems) == 2 and all(f"block {lost['block_id']}:" in p for p in problems)  # only the lost one

    assert sched.lookup(prompt.hashes, prompt.num_tokens).hit_tokens == 16  # and later lookups stop before it
