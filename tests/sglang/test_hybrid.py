"""SGLang's hybrid cache through KVSidecarStorage's v2 calls: SGLang's own MHA, Mamba and sliding-window host pools in
one session of the daemon, against a real daemon over its real socket.

As SGLang's HybridCacheController drives a backend: KV pages by batch_*_v1; the side pools by batch_*_v2, a Mamba
state per radix node (the state at the node's end, keyed by its last page's hash: TRAILING_PAGES, one key) and a
node's sliding-window pages (TRAILING_PAGES, the window's pages); and batch_exists_v2 for what a prefetch may load.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (setup-sglang.sh)")

WINDOW_PAGES = 2  # SGLang's full_window_pages for a window of 2 pages


def _keys(start: int, count: int) -> list[str]:
    return [f"{start + i:064x}" for i in range(count)]


def _tokens(pages: list[int]):  # -> torch.Tensor
    import torch
    from pools import PAGE

    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _trailing(window: int = WINDOW_PAGES) -> list:
    """The side pools' transfers of a prefetch query, before SGLang knows the hit: placeholder keys, as it sends."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    trailing = PoolHitPolicy.TRAILING_PAGES
    return [
        PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=trailing),
        PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * window, hit_policy=trailing),
    ]


def _side(name: str, keys: list[str], host_indices):  # -> PoolTransfer
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(
        name=PoolName(name), host_indices=host_indices, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )


def _hybrid(daemon, prefix, model, seed, *, tp_rank=0, tp_size=1, swa=True, **more):
    """A rank's KV, Mamba and (optionally) sliding-window pools of SGLang's classes, filled, and its backend."""
    from pools import PAGE, backend, extra_config, fill, host_pool, mamba_pool

    pools = {"kv": host_pool("mha", "page_first"), "mamba": mamba_pool()}
    if swa:
        pools["swa"] = host_pool("mha", "page_first")
    for offset, pool in enumerate(pools.values()):
        fill(pool, seed + offset)
    extra = extra_config(daemon.target, cache_prefix=prefix, sliding_window=WINDOW_PAGES * PAGE, **more)
    side = {name: pool for name, pool in pools.items() if name != "kv"}
    storage = backend(pools["kv"], model, extra, tp_rank=tp_rank, tp_size=tp_size, side_pools=side)
    return pools, storage


def test_a_hybrid_pool_round_trips_through_v2_and_exists_asks_every_pool(daemon, cache_prefix, model):
    import torch
    from pools import page_bytes

    keys = _keys(0xE0, 6)
    # Writer shared in place, reader staged: each path reads the other's values.
    pools, writer = _hybrid(daemon, cache_prefix, model, 40)
    fresh, reader = _hybrid(daemon, cache_prefix, model, 90, zero_copy=False)
    try:
        kv_pages, swa_pages = [3, 1, 5, 0, 2, 4], [6, 2, 7, 1, 3, 5]
        assert writer.batch_set_v1(keys, _tokens(kv_pages)) == [True] * 6
        # Two radix nodes, pages [0, 3) and [3, 6): each backs up its window pages and the state at its end.
        assert writer.batch_set_v2([_side("swa", keys[:3], _tokens(swa_pages[:3]))]) == {"swa": [True] * 3}
        assert writer.batch_set_v2([_side("mamba", keys[2:3], torch.tensor([5]))]) == {"mamba": [True]}
        both = writer.batch_set_v2(
            [_side("swa", keys[3:], _tokens(swa_pages[3:])), _side("mamba", keys[5:], torch.tensor([2]))]
        )
        assert both == {"swa": [True] * 3, "mamba": [True]}

        full = reader.batch_exists_v2(keys, _trailing())
        assert (full.kv_hit_pages, full.restorable_prefix_pages) == (6, [6])
        # Five pages: no state at 5, so the longest prefix every pool serves ends at the state at 3.
        assert reader.batch_exists_v2(keys[:5], _trailing()).kv_hit_pages == 3
        assert reader.batch_exists_v2(_keys(0x1E0, 6), _trailing()).kv_hit_pages == 0
        # A window the session does not have is a miss, never a guess at a hit SGLang would load wrong.
        assert reader.batch_exists_v2(keys, _trailing(WINDOW_PAGES + 1)).kv_hit_pages == 0
        # The KV-only query asks every group of the session too (the daemon's rule 9).
        assert reader.batch_exists(keys) == 6 and reader.batch_exists(keys[:5]) == 3

        # A prefetch of the six pages: KV first (v1), then the side pools at the hit's end (v2).
        assert reader.batch_get_v1(keys, _tokens([9, 8, 7, 6, 10, 11])) == [True] * 6
        at_end = [_side("mamba", keys[5:], torch.tensor([7])), _side("swa", keys[4:], _tokens([9, 8]))]
        got = reader.batch_get_v2(at_end)
        assert got == {"mamba": [True], "swa": [True, True]}
        assert reader.batch_get_v2([_side("mamba", keys[4:5], torch.tensor([6]))]) == {"mamba": [False]}
        expected = [("kv", w, r) for w, r in zip(kv_pages, [9, 8, 7, 6, 10, 11], strict=True)]
        expected += [("mamba", 2, 7), ("swa", 3, 9), ("swa", 5, 8)]
        for name, w, r in expected:
            assert page_bytes(fresh[name], r) == page_bytes(pools[name], w), (name, w, r)
    finally:
        writer.close()
        reader.close()


def test_a_mamba_state_is_per_tp_rank_and_a_prefix_needs_every_ranks(daemon, cache_prefix, model):
    import torch
    from pools import page_bytes

    keys = _keys(0xF0, 4)
    ranks = [_hybrid(daemon, cache_prefix, model, 10 * (r + 1), tp_rank=r, tp_size=2, swa=False) for r in (0, 1)]
    (pools0, rank0), (pools1, rank1) = ranks
    mamba = _trailing()[:1]
    try:
        for _, storage in ranks:
            assert storage.batch_set_v1(keys, _tokens([0, 1, 2, 3])) == [True] * 4
            assert storage.batch_set_v2([_side("mamba", keys[1:2], torch.tensor([0]))]) == {"mamba": [True]}
        assert rank0.batch_set_v2([_side("mamba", keys[3:], torch.tensor([1]))]) == {"mamba": [True]}
        # Rank 1 has no state at 4 pages yet: no rank may restore 4, both may restore 2.
        assert [s.batch_exists_v2(keys, mamba).kv_hit_pages for _, s in ranks] == [2, 2]
        assert rank1.batch_set_v2([_side("mamba", keys[3:], torch.tensor([1]))]) == {"mamba": [True]}
        assert [s.batch_exists_v2(keys, mamba).kv_hit_pages for _, s in ranks] == [4, 4]
        # Each rank reads its own state, never the other's.
        for pools, storage in ranks:
            assert storage.batch_get_v2([_side("mamba", keys[3:], torch.tensor([5]))]) == {"mamba": [True]}
            assert page_bytes(pools["mamba"], 5) == page_bytes(pools["mamba"], 1)
        assert page_bytes(pools0["mamba"], 5) != page_bytes(pools1["mamba"], 5)
    finally:
        rank0.close()
        rank1.close()
