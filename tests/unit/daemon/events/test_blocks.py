"""A save's written values as BlockStored events: complete blocks only, runs per group, hashes at block ends."""

from __future__ import annotations

from kvsidecar.events.blocks import GroupInfo, groups_of, stored_events
from kvsidecar.events.messages import MEDIUM_CPU
from kvsidecar_contract.placement import Chunk, Geometry, GroupSpec, Kind, Layout, Parallel

U = 16
H = [bytes([i]) * 4 for i in range(1, 13)]  # the hash of tokens [0, (i+1)*U)


def chunk(group: int, index: int, boundary: int) -> Chunk:
    return Chunk(group, index, boundary, block_id=index, key=f"k{group}/{boundary}")


def test_consecutive_blocks_are_one_event_and_a_gap_starts_another():
    groups = [GroupInfo(U, "full_attention", None)]
    written = [chunk(0, i, (i + 1) * U) for i in (0, 1, 3)]
    events, blocks = stored_events(groups, U, H, written, MEDIUM_CPU, list(range(100, 164)), 0)
    assert [e.block_hashes for e in events] == [[H[0], H[1]], [H[3]]]
    assert [e.parent_block_hash for e in events] == [None, H[2]]
    assert events[0].token_ids == list(range(100, 132))
    assert events[1].token_ids == list(range(148, 164))
    assert [b.block_hash for b in blocks] == [H[0], H[1], H[3]]


def test_a_block_of_several_hash_units_is_named_by_the_hash_at_its_end_as_vllm_names_it():
    groups = [GroupInfo(2 * U, "sliding_window", 64)]
    events, _ = stored_events(groups, U, H, [chunk(0, 1, 4 * U), chunk(0, 2, 6 * U)], MEDIUM_CPU)
    (event,) = events
    assert event.block_hashes == [H[3], H[5]]
    assert event.parent_block_hash == H[1]
    assert (event.block_size, event.kv_cache_spec_sliding_window) == (2 * U, 64)
    assert event.token_ids == []  # no tokens sent


def test_partial_blocks_and_tokens_that_do_not_cover_a_run_are_left_out():
    groups = [GroupInfo(2 * U, "full_attention", None), GroupInfo(U, "mamba", None)]
    # Group 0's last value ends inside a block (a fine-grained tail): stored for lookups, no block for a router.
    written = [chunk(0, 0, 2 * U), chunk(0, 1, 3 * U), chunk(1, 2, 3 * U)]
    events, blocks = stored_events(groups, U, H, written, MEDIUM_CPU, list(range(U, 3 * U)), U)
    assert [(e.group_idx, e.block_hashes, e.token_ids) for e in events] == [
        (0, [H[1]], []),  # its tokens start at 0, before those sent
        (1, [H[2]], list(range(2 * U, 3 * U))),
    ]
    assert len(blocks) == 2


def test_groups_carry_vllms_kind_names():
    layout = Layout(
        model="m",
        parallel=Parallel(),
        num_kv_heads=1,
        hash_block_size=U,
        groups=(GroupSpec(Kind.MLA, U), GroupSpec(Kind.SLIDING_WINDOW, U, window=128)),
    )
    assert groups_of(Geometry.of(layout)) == (GroupInfo(U, "mla_attention", None), GroupInfo(U, "sliding_window", 128))
