"""Staged lookups answer exactly what probing every key answers, probing only keys of the full plan."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_properties import SETTINGS, hashes_for, layouts

from kvsidecar_contract.placement import (
    Geometry,
    GroupSpec,
    Hit,
    Kind,
    Layout,
    PackedHashes,
    Parallel,
    RequestMismatch,
    StagedLookup,
    compute_hit,
    lookup_plan,
)
from support.ranks import all_ranks

PRESENT, ABSENT, UNKNOWN = 1, 0, -1


def run_staged(geo: Geometry, hashes: Sequence[bytes], num_tokens: int, eagle: bool, answer: dict[str, int]):
    """The staged lookup against a store answering from `answer`; returns it and every key it asked."""
    staged = StagedLookup(geo, hashes, num_tokens, eagle=eagle)
    asked: list[str] = []
    while not staged.done:
        keys = staged.next_keys()
        asked += keys
        staged.record([answer[k] == PRESENT for k in keys])
    return staged, asked


def stored_answers(keys: list[str], rng: random.Random, n: int) -> dict[str, int]:
    """A store's answers: mostly stored below a random cut, sparse above it, some keys failing (-1)."""
    cut = rng.randrange(n + 1)
    keep = rng.choice([0.5, 0.9, 0.97, 1.0])
    above = rng.choice([0.0, 0.3, 0.9])
    fail = rng.choice([0.0, 0.0, 0.02, 0.2])
    out = {}
    for k in keys:
        index = int(k.rsplit("@", 1)[1], 16) % 100_000
        p = keep if index < cut else above
        out[k] = UNKNOWN if rng.random() < fail else (PRESENT if rng.random() < p else ABSENT)
    return out


@SETTINGS
@given(layouts(), st.integers(0, 60), st.booleans(), st.integers(0, 2**32 - 1))
def test_staged_answer_equals_probing_every_key(layout, n, eagle, seed):
    rng = random.Random(seed)
    u = layout.hash_block_size
    num_tokens = n * u + rng.randrange(u)
    hashes = hashes_for(num_tokens, u)[: rng.randint(max(0, n - 2), n)] if n else []
    geo = all_ranks(layout)[0][1]
    plan = lookup_plan(geo, hashes, num_tokens)
    answer = stored_answers(plan.keys, rng, len(hashes))
    every = compute_hit(geo, num_tokens, plan.stored([answer[k] == PRESENT for k in plan.keys]), eagle=eagle)

    staged, asked = run_staged(geo, hashes, num_tokens, eagle, answer)
    assert staged.answer() == every
    assert len(asked) == len(set(asked)) == staged.probes  # no key asked twice
    # The same hashes packed into one bytes object (as a Lookup may send them): the same keys, the same answer.
    packed = PackedHashes.of(hashes, 32)
    assert lookup_plan(geo, packed, num_tokens).keys == plan.keys
    assert run_staged(geo, packed, num_tokens, eagle, answer)[1] == asked
    assert set(asked) <= set(plan.keys)
    failed = [k for k in asked if answer[k] == UNKNOWN]
    if failed:
        assert any(answer[k] == UNKNOWN for k in plan.keys)  # degraded only where probing everything is
    else:
        # Not degraded: no failed key it skipped could change the answer, whatever its truth.
        resolved = plan.stored([answer[k] != ABSENT for k in plan.keys])
        assert compute_hit(geo, num_tokens, resolved, eagle=eagle) == every


@SETTINGS
@given(layouts(), st.integers(1, 40), st.booleans())
def test_a_store_failing_every_probe_is_a_degraded_miss(layout, n, eagle):
    u = layout.hash_block_size
    geo = all_ranks(layout)[0][1]
    hashes = hashes_for(n * u + 1, u)
    plan = lookup_plan(geo, hashes, n * u + 1)
    staged, asked = run_staged(geo, hashes, n * u + 1, eagle, dict.fromkeys(plan.keys, UNKNOWN))
    assert staged.answer() == Hit(0, (0,) * len(geo.groups))
    best = compute_hit(geo, n * u + 1, plan.stored([True] * len(plan.keys)), eagle=eagle)
    # The first stage's keys all failed, so the answer says it is degraded, unless no store could give a hit.
    assert asked or best.hit_tokens == 0


def bench_geometry() -> Geometry:
    groups = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    return Geometry.of(Layout("org/M", groups, Parallel(tp_size=8), num_kv_heads=8, hash_block_size=16))


def test_a_miss_probes_one_small_batch_then_the_first_block():
    geo = bench_geometry()
    hashes = hashes_for(8192 * 16, 16)
    answer = dict.fromkeys(lookup_plan(geo, hashes, 8192 * 16).keys, ABSENT)
    staged, asked = run_staged(geo, hashes, 8192 * 16, False, answer)
    assert staged.answer() == Hit(0, (0, 0, 0))
    assert len(asked) == 64  # stage 1: 64 MLA boundaries; its first block is missing, so nothing more matters


def test_a_partial_hit_stops_stage_one_at_the_first_missing_block():
    geo = bench_geometry()
    hashes = hashes_for(1000 * 16, 16)
    plan = lookup_plan(geo, hashes, 1000 * 16)
    answer = {k: PRESENT if int(k.rsplit("@", 1)[1], 16) < 100 else ABSENT for k in plan.keys}
    staged, asked = run_staged(geo, hashes, 1000 * 16, False, answer)
    assert staged.answer() == compute_hit(geo, 1000 * 16, plan.stored([answer[k] == PRESENT for k in plan.keys]))
    assert staged.answer().hit_tokens == 1600
    assert len(asked) < len(plan.keys) // 4


def test_recording_the_wrong_number_of_answers_is_refused():
    geo = bench_geometry()
    staged = StagedLookup(geo, hashes_for(64, 16), 64)
    staged.next_keys()
    with pytest.raises(RequestMismatch):
        staged.record([True])
