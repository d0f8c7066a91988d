"""One cache across TP sizes (docs/placement.md rule 11), through a real daemon and a real Mooncake master.

A TP=1 writer holding both KV heads saves a prompt; TP=2 readers (one head each) and TP=4 readers (each head on two
ranks) look it up from their own sessions and load exactly their own head's bytes, byte for byte, and the reverse
(TP=2 writers, a TP=1 reader). Values saved without sharing stay per layout: a reader of another TP size misses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvsidecar_client import EngineLayout, InvalidRequest, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_testing.processes import DaemonProcess

pytestmark = pytest.mark.integration

HEADS = 2
BLOCKS = 4
HASHES = [bytes([9, i]) * 16 for i in range(1, BLOCKS + 1)]  # four blocks of 16 tokens
TOKENS = 16 * BLOCKS
ATTENTION = [ClientGroup("full_attention", block_size=16)]


def kv_cache(heads: int) -> torch.Tensor:
    """One layer's K and V as vLLM's CPU backend lays them out: (2, blocks, heads, block_size, head_size), HND."""
    return shared_tensor((2, 8, heads, 16, 32), torch.float16)


@contextlib.contextmanager
def rank(
    daemon: DaemonProcess,
    prefix: str,
    tp: int,
    r: int,
    groups: Sequence[ClientGroup] = ATTENTION,
    share: bool | int = True,
    heads: int = HEADS,
) -> Iterator[tuple[SidecarClient, torch.Tensor]]:
    kv = kv_cache(max(1, heads // tp))
    client = SidecarClient.connect(
        daemon.target, model="org/Llama", layout=EngineLayout(tp_size=tp, tp_rank=r), num_kv_heads=heads,
        hash_block_size=16, groups=groups, cache_prefix=prefix, value_identity="w", share_across_tp=share,
    )  # fmt: skip
    try:
        client.register([kv[0], kv[1]], groups_of_tensor=[(0,), (0,)], head_dims=[1, 1])
        yield client, kv
    finally:
        client.close()


def head(kv: torch.Tensor, blocks: slice, h: int) -> torch.Tensor:
    return kv[:, blocks, h].contiguous().view(torch.uint8)


def fill(kv: torch.Tensor, seed: int) -> None:
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))


def test_a_tp1_prompt_is_a_byte_exact_hit_for_tp2_and_tp4_ranks(daemon, key_prefix):
    with rank(daemon, key_prefix, 1, 0) as (writer, kv):
        fill(kv, 11)
        saved = writer.save(HASHES, [[0, 1, 2, 3]], TOKENS).result(timeout=60)
        assert (saved.written, saved.failed) == (BLOCKS * HEADS, 0)  # one value per head per block
        for tp in (2, 4):
            for r in range(tp):
                with rank(daemon, key_prefix, tp, r) as (reader, mine):
                    hit = reader.lookup(HASHES, TOKENS + 1)
                    assert hit.hit_tokens == TOKENS
                    assert reader.load(HASHES, [[4, 5, 6, 7]], hit) == set()
                    h = r * HEADS // tp  # the head this rank holds
                    assert torch.equal(head(mine, slice(4, 8), 0), head(kv, slice(0, 4), h)), (tp, r)


def test_values_of_two_heads_shared_by_a_tp1_writer_and_tp2_readers(daemon, key_prefix):
    # share_across_tp=2 with four heads: values of two heads (half as many keys as one per head).
    with rank(daemon, key_prefix, 1, 0, share=2, heads=4) as (writer, kv):
        fill(kv, 41)
        assert writer.save(HASHES, [[0, 1, 2, 3]], TOKENS).result(timeout=60).written == BLOCKS * 2
        for r in range(2):
            with rank(daemon, key_prefix, 2, r, share=2, heads=4) as (reader, mine):
                hit = reader.lookup(HASHES, TOKENS + 1)
                assert hit.hit_tokens == TOKENS
                assert reader.load(HASHES, [[4, 5, 6, 7]], hit) == set()
                for h in range(2):
                    assert torch.equal(head(mine, slice(4, 8), h), head(kv, slice(0, 4), 2 * r + h)), (r, h)
        refused = "share_tp_size 2 stores values of 2 KV heads; a TP=4 rank holds 1"
        with pytest.raises(InvalidRequest, match=refused), rank(daemon, key_prefix, 4, 0, share=2, heads=4):
            pass


def test_tp2_writers_fill_a_tp1_readers_every_head(daemon, key_prefix):
    with rank(daemon, key_prefix, 2, 0) as (w0, kv0), rank(daemon, key_prefix, 2, 1) as (w1, kv1):
        fill(kv0, 21)
        fill(kv1, 22)
        assert w0.save(HASHES, [[0, 1, 2, 3]], TOKENS).result(timeout=60).written == BLOCKS
        with rank(daemon, key_prefix, 1, 0) as (reader, mine):
            assert reader.lookup(HASHES, TOKENS + 1).hit_tokens == 0  # head 1 is not stored yet: never half a block
            assert w1.save(HASHES, [[0, 1, 2, 3]], TOKENS).result(timeout=60).written == BLOCKS
            hit = reader.lookup(HASHES, TOKENS + 1)
            assert hit.hit_tokens == TOKENS
            assert reader.load(HASHES, [[1, 2, 3, 4]], hit) == set()
            assert torch.equal(head(mine, slice(1, 5), 0), head(kv0, slice(0, 4), 0))
            assert torch.equal(head(mine, slice(1, 5), 1), head(kv1, slice(0, 4), 0))


def test_without_sharing_or_with_a_state_group_another_tp_size_misses(daemon, key_prefix):
    with rank(daemon, key_prefix, 1, 0, share=False) as (writer, kv):
        fill(kv, 31)
        assert writer.save(HASHES, [[0, 1, 2, 3]], TOKENS).result(timeout=60).written == BLOCKS
        with rank(daemon, key_prefix, 2, 0, share=False) as (reader, _):
            assert reader.lookup(HASHES, TOKENS + 1).hit_tokens == 0
        with rank(daemon, key_prefix, 2, 0) as (reader, _):
            assert reader.lookup(HASHES, TOKENS + 1).hit_tokens == 0  # the per-layout values are not shared ones


def test_a_token_major_layout_cannot_share_and_says_why(daemon, key_prefix):
    kv = shared_tensor((2, 8, 16, HEADS, 32), torch.float16)  # NHD: one head's bytes are 16 ranges per block
    client = SidecarClient.connect(
        daemon.target, model="org/Llama", layout=EngineLayout(), num_kv_heads=HEADS, hash_block_size=16,
        groups=ATTENTION, cache_prefix=key_prefix, value_identity="w", share_across_tp=True,
    )  # fmt: skip
    try:
        with pytest.raises(InvalidRequest, match=r"not the outermost dim of a block \(a token-major layout"):
            client.register([kv[0], kv[1]], groups_of_tensor=[(0,), (0,)], head_dims=[2, 2])
        with pytest.raises(InvalidRequest, match="register must be told which dim holds the KV heads"):
            client.register([kv[0], kv[1]], groups_of_tensor=[(0,), (0,)])
    finally:
        client.close()
