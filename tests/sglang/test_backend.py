"""KVSidecarStorage with SGLang's own classes (its backend factory, its MHA and MLA host pools in page_first and
layer_first, its shm allocator) against a real daemon over its real socket."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (setup-sglang.sh)")

HERE = Path(__file__).resolve().parent
RANK_TIMEOUT_S = 240


def _in_place(pool: object) -> bool:
    """Whether the pool's buffer now lives in a sealed memfd of the rank's own, at the address SGLang mapped."""
    from kvsidecar_client.memory import segment_of

    segment = segment_of(pool.kv_buffer)  # type: ignore[attr-defined]
    return segment is not None and segment.sealed


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_round_trip_byte_exact_and_exists_counts_the_stored_prefix(daemon, cache_prefix, model, kind, layout):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool

    keys = [f"{0xB0 + i:064x}" for i in range(5)]
    missing = f"{0xFF:064x}"
    writer_pool = host_pool(kind, layout)
    fill(writer_pool, 7)
    address = writer_pool.kv_buffer.data_ptr()
    # The writer's pool is shared in place (zero-copy), the reader's copied through its staging area (three pages
    # for five: two turns): each path reads what the other wrote.
    writer = backend(writer_pool, model, extra_config(daemon.target, cache_prefix=cache_prefix), mla=kind == "mla")
    reader_pool = host_pool(kind, layout)
    reader_extra = extra_config(daemon.target, cache_prefix=cache_prefix, zero_copy=False, staging_pages=3)
    reader = backend(reader_pool, model, reader_extra, mla=kind == "mla")
    try:
        assert type(writer).__name__ == "KVSidecarStorage"
        assert _in_place(writer_pool) and writer_pool.kv_buffer.data_ptr() == address
        assert not _in_place(reader_pool)
        assert reader.batch_exists(keys) == 0
        write_pages, read_pages = [6, 1, 8, 3, 10], [20, 15, 25, 12, 30]
        written = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in write_pages])
        assert writer.batch_set_v1(keys, written) == [True] * 5
        assert writer.batch_set_v1(keys, written) == [True] * 5  # already stored: skipped, still True
        assert reader.batch_exists(keys) == 5
        assert reader.batch_exists([*keys[:3], missing, *keys[4:]]) == 3
        assert reader.batch_exists([missing, *keys]) == 0
        assert reader.exists(keys[0]) and not reader.exists(missing)
        read = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in [*read_pages, 31]])
        assert reader.batch_get_v1([*keys, missing], read) == [True] * 5 + [False]
        for w, r in zip(write_pages, read_pages, strict=True):
            got = reader_pool.get_data_page(r * PAGE).view(torch.uint8)
            assert torch.equal(got, writer_pool.get_data_page(w * PAGE).view(torch.uint8)), f"page {w} -> {r}"
        # And back: the pool shared in place loads what the staged one wrote.
        assert reader.batch_set_v1(keys[:2], torch.arange(0, 2 * PAGE)) == [True, True]
        assert writer.batch_get_v1(keys[:2], torch.arange(2 * PAGE, 4 * PAGE)) == [True, True]
        assert (
            writer_pool.get_data_page(2 * PAGE)
            .view(torch.uint8)
            .equal(writer_pool.get_data_page(6 * PAGE).view(torch.uint8))
        )
    finally:
        writer.close()
        reader.close()


def test_two_tp_ranks_write_and_a_fresh_process_reads_every_page(daemon, cache_prefix, model):
    from rank import write_pages

    before = daemon.requests_by_method()
    job = {"socket": daemon.target, "model": model, "prefix": cache_prefix, "tp_size": 2}
    # Rank 0 and rank 1 write here (each a session of its own); a process that never held the pools reads.
    assert write_pages(job, 0) == {"mha": [True] * 6, "mla": [True] * 6}
    assert write_pages(job, 1) == {"mha": [True] * 6, "mla": []}  # not an MLA storage writer
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(HERE / "rank.py"), json.dumps({**job, "tp_ranks": [0, 1]})],
        cwd=HERE, capture_output=True, text=True, timeout=RANK_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"reader failed ({proc.returncode}): {proc.stderr[-3000:]}"
    readers = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank in ("0", "1"):
        for kind in ("mha", "mla"):
            # Each rank reads its own MHA heads (rank 1 its own seed's bytes) and rank 0's MLA latent.
            assert readers[rank][kind] == {"get": [True] * 6, "exact": [True] * 6, "exists": 6}, (rank, kind)
    after = daemon.requests_by_method()
    # The daemon counted the SGLang sessions' calls as any session's (its metrics, per method).
    for method in ("Save", "Load", "Lookup"):
        assert after.get(method, 0) > before.get(method, 0), method


def test_truncating_sglangs_own_memfd_reaches_nobody_and_the_new_one_cannot_shrink(daemon, cache_prefix, model):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool, page_bytes

    from kvsidecar_client.memory import segment_of

    pool = host_pool("mha", "page_first")
    fill(pool, 3)
    before = [page_bytes(pool, p) for p in range(2)]
    storage = backend(pool, model, extra_config(daemon.target, cache_prefix=cache_prefix))
    try:
        keys = [f"{0xC0 + i:064x}" for i in range(2)]
        assert storage.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
        # SGLang's memfd backs nothing any more: its pages went with the move, and shrinking it touches no mapping.
        assert os.fstat(pool.fd).st_blocks == 0
        os.ftruncate(pool.fd, 0)
        assert [page_bytes(pool, p) for p in range(2)] == before
        # The memfd the pool lives in now is sealed: not even its owner can shrink it under the daemon.
        segment = segment_of(pool.kv_buffer)
        assert segment is not None
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 0)
        assert storage.batch_get_v1(keys, torch.arange(4 * PAGE, 6 * PAGE)) == [True, True]
        assert [page_bytes(pool, p) for p in (4, 5)] == before
    finally:
        storage.close()
    assert daemon.alive()
    assert daemon.status(quiet=True).returncode == 0


def test_the_daemon_refuses_sglangs_pool_memfd_itself(daemon, cache_prefix, model):
    # Why the pool moves: registering SGLang's own memfd is refused (it can never be sealed against shrinking).
    from pools import host_pool

    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient
    from kvsidecar_client.errors import InvalidRequest
    from kvsidecar_client.memory import SharedMemory, _segments, _segments_lock

    pool = host_pool("mha", "page_first")
    view = pool.kv_buffer[0].unflatten(0, (pool.page_num, pool.page_size))
    client = SidecarClient.connect(daemon.target, model=model, layout=EngineLayout(), num_kv_heads=2,
                                   hash_block_size=pool.page_size, groups=[GroupSpec("full_attention", 4)],
                                   cache_prefix=cache_prefix)  # fmt: skip
    base = view.untyped_storage().data_ptr()
    with _segments_lock:
        _segments[base] = SharedMemory("", os.fstat(pool.fd).st_size, pool.fd)
    try:
        with pytest.raises(InvalidRequest, match="not sealed against shrinking"):
            client.register([view], [(0,)])
    finally:
        with _segments_lock:
            _segments.pop(base, None)
        client.close()


def test_another_namespace_gets_nothing_and_an_ungranted_prefix_is_refused(daemon, cache_prefix, model):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool

    from kvsidecar_client.errors import PermissionDenied

    keys = [f"{0xD0 + i:064x}" for i in range(3)]
    pool = host_pool("mha", "page_first")
    fill(pool, 5)
    mine = backend(pool, model, extra_config(daemon.target, cache_prefix=cache_prefix))
    theirs = backend(
        host_pool("mha", "page_first"), model, extra_config(daemon.target, cache_prefix=cache_prefix + "b")
    )
    try:
        assert mine.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
        # Another deployment's namespace (its cache prefix) holds none of it.
        assert theirs.batch_exists(keys) == 0
        assert theirs.batch_get_v1(keys, torch.arange(8 * PAGE, 11 * PAGE)) == [False] * 3
    finally:
        mine.close()
        theirs.close()
    # The daemon's tenants file grants this account the prefixes t*: rights are off unless granted.
    with pytest.raises(PermissionDenied):
        backend(host_pool("mha", "page_first"), model, extra_config(daemon.target, cache_prefix="beta"))


def test_a_save_publishes_its_pages_with_their_parent_and_no_tokens(daemon, cache_prefix, model):
    import msgspec
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvsidecar.events.messages import KVEventBatch
    from support.kv_subscriber import KvSubscriber, stored_hashes

    sub = KvSubscriber(*daemon.events, "kvsidecar.sglang", msgspec.msgpack.Decoder(KVEventBatch).decode)
    pool = host_pool("mha", "page_first")
    fill(pool, 11)
    storage = backend(pool, model, extra_config(daemon.target, cache_prefix=cache_prefix))
    try:
        # A child radix node's pages: the chain before them comes as prefix_keys (SGLang's extra_info).
        chain = [f"{0x5A0 + i:064x}" for i in range(5)]
        info = HiCacheStorageExtraInfo(prefix_keys=chain[:2])
        assert storage.batch_set_v1(chain[2:], torch.arange(0, 3 * PAGE), info) == [True] * 3
        # The topic's earlier messages (other tests' saves) come too, from the replay socket.
        ours = [bytes.fromhex(k) for k in chain[2:]]
        batches = sub.collect(lambda bs: set(ours) <= set(stored_hashes(bs)))
    finally:
        storage.close()
        sub.close()
    (event,) = [e for b in batches for e in b.events if set(getattr(e, "block_hashes", ())) & set(ours)]
    assert event.block_hashes == ours
    # Its parent is the page before it in the chain, not the start of a prompt; SGLang's calls carry no tokens.
    assert (event.parent_block_hash, event.token_ids) == (bytes.fromhex(chain[1]), [])
    assert (event.block_size, event.kv_cache_spec_kind) == (PAGE, "full_attention")
