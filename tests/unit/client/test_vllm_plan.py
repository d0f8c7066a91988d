"""The connector's save checks and load reads (vllm/plan.py): pure, so they run without vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsidecar_client import NO_BLOCK, EngineLayout, GroupSpec, SessionSpec, Unsupported
from kvsidecar_client.results import GroupPlacement, SessionInfo
from kvsidecar_client.vllm.plan import check_save, load_block_ids, saved_chunks, shape_of
from kvsidecar_contract.placement import Geometry, load_plan


def session(*groups: GroupSpec, dcp_size: int = 1, tp_size: int = 1, hash_block_size: int = 16) -> SessionSpec:
    return SessionSpec(
        model="org/Model",
        layout=EngineLayout(tp_size=tp_size, dcp_size=dcp_size),
        num_kv_heads=1,
        hash_block_size=hash_block_size,
        groups=groups,
    )


ATTN_MAMBA = shape_of(session(GroupSpec("full_attention", 16), GroupSpec("mamba", 16)))
NULL = 0


# ---- which blocks a save reads, and when it must not be sent (moved from tests/vllm_connector/test_specs.py) ----


def test_a_save_stores_each_new_block_under_its_end():
    assert saved_chunks(ATTN_MAMBA, 48, 16) == [[(1, 32), (2, 48)], [(1, 32), (2, 48)]]


def test_a_recurrent_group_is_saved_only_for_the_state_it_holds():
    # One block per step: the recurrent state in memory is the state after exactly num_tokens tokens.
    ok = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, 5, 6]], 48, 32, NULL)
    assert ok.ok and ok.reads == {3, 6} and ok.chunks == 2
    assert ok.block_ids == ((1, 2, 3), (NULL, 5, 6))
    # A whole prompt in one step: the states after 16 and 32 tokens were never kept. Those spans go as NO_BLOCK
    # (the daemon skips them); the attention blocks and the state after 48 are stored.
    whole = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, NULL, 6]], 48, 0, NULL)
    assert whole.ok and whole.reads == {1, 2, 3, 6} and whole.chunks == 4
    assert whole.block_ids == ((1, 2, 3), (NO_BLOCK, NO_BLOCK, 6))
    assert "state after 16" in whole.reason
    # Nothing right to store: not sent at all.
    none = check_save(ATTN_MAMBA, [[1, 2, 3], [NULL, NULL, NULL]], 48, 32, NULL)
    assert (none.ok, none.chunks) == (True, 1)  # the attention block 3 still is
    mamba_only = shape_of(session(GroupSpec("mamba", 16)))
    assert not check_save(mamba_only, [[NULL, NULL, NULL]], 48, 0, NULL).ok


def test_a_null_block_is_never_read():
    swa = shape_of(session(GroupSpec("sliding_window", 16, 32)))
    retired = check_save(swa, [[NULL, 2, 3]], 48, 0, NULL)  # the window retired block 0
    assert retired.reads == {2, 3} and retired.block_ids == ((NO_BLOCK, 2, 3),)
    assert check_save(swa, [[NULL, 2, 3]], 48, 16, NULL).reads == {2, 3}


def test_a_load_writes_the_hit_blocks_past_the_local_prefix():
    ids = [[1, 2, 3, 4], [9, 9, 7, 8]]
    assert load_block_ids(ATTN_MAMBA, ids, 64, 16) == [[2, 3, 4], [8]]
    assert load_block_ids(ATTN_MAMBA, ids, 16, 16) == [[], []]


# ---- the two cases where the connector's own copy of the rules had drifted from the daemon's ----


@pytest.mark.parametrize(
    ("group", "written"),
    [
        # An attention member makes the packed value one that needs every block (or the window's), like the
        # daemon reads it; the old copy treated any recurrent member as "the state at the hit end only": [13].
        (GroupSpec("uniform", 16, inner=("mla", "mamba")), [10, 11, 12, 13]),
        (GroupSpec("uniform", 16, 32, inner=("sliding_window", "mamba")), [12, 13]),
    ],
)
def test_a_load_reads_exactly_the_blocks_the_daemon_writes(group, written):
    spec = session(group)
    ids = [[10, 11, 12, 13]]
    assert load_block_ids(shape_of(spec), ids, 64, 0) == [written]
    daemon = load_plan(Geometry.of(spec.to_placement()), [bytes(32)] * 4, ids, 64, (64,))
    assert [c.block_id for c in daemon] == written


def test_spans_follow_dcp_and_fine_grained_hits():
    spans = shape_of(session(GroupSpec("full_attention", 16), GroupSpec("mamba", 64), tp_size=2, dcp_size=2))
    assert (spans.spans, spans.fine_grained, spans.unit, spans.hash_block_size) == ((32, 64), True, 16, 16)


def test_a_daemon_placing_otherwise_is_refused():
    spec = session(GroupSpec("full_attention", 16), GroupSpec("mamba", 64))
    agree = SessionInfo(10_000, 16, True, (GroupPlacement(1, 0, 1, 16), GroupPlacement(1, 0, 1, 64)), "v")
    assert shape_of(spec, agree).spans == (16, 64)
    skewed = agree._replace(groups=(GroupPlacement(1, 0, 1, 16), GroupPlacement(1, 0, 1, 16)))
    with pytest.raises(Unsupported, match="install matching versions"):
        shape_of(spec, skewed)
    with pytest.raises(Unsupported):
        shape_of(spec, agree._replace(fine_grained_hits=False))


def test_plan_imports_without_vllm():
    # A None entry in sys.modules makes `import vllm` fail, as on a machine without vLLM.
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvsidecar_client.vllm.plan\n"
        "import kvsidecar_client.vllm as v\n"
        "assert 'kvsidecar_client.vllm.connector' not in sys.modules\n"
        "try:\n    v.KVSidecarConnector\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('vLLM imported')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
