"""KVSidecarStorage with SGLang's own classes (its backend factory, its MHA and MLA host pools in page_first and
layer_first, its shm allocator) against a real daemon over its real socket."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (setup-sglang.sh)")

HERE = Path(__file__).resolve().parent
RANK_TIMEOUT_S = 240


def _rank(job: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-W", "ignore", str(HERE / "rank.py"), json.dumps(job)],
        cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _results(procs: list[subprocess.Popen[str]]) -> list[dict]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=RANK_TIMEOUT_S)
        assert proc.returncode == 0, f"rank failed ({proc.returncode}): {stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pools import model_dir

    return str(model_dir(tmp_path_factory.mktemp("model")))


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_round_trip_byte_exact_and_exists_counts_the_stored_prefix(daemon, cache_prefix, model, kind, layout):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool

    extra = extra_config(daemon.target, cache_prefix=cache_prefix, staging_pages=3)
    keys = [f"{0xB0 + i:064x}" for i in range(5)]
    missing = f"{0xFF:064x}"
    writer_pool = host_pool(kind, layout)
    fill(writer_pool, 7)
    writer = backend(writer_pool, model, extra, mla=kind == "mla")
    reader_pool = host_pool(kind, layout)
    reader = backend(reader_pool, model, extra, mla=kind == "mla")
    try:
        assert type(writer).__name__ == "KVSidecarStorage"
        assert reader.batch_exists(keys) == 0
        write_pages, read_pages = [6, 1, 8, 3, 10], [20, 15, 25, 12, 30]
        written = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in write_pages])
        # Five pages through a three-page staging area: two turns.
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
    finally:
        writer.close()
        reader.close()


def test_two_tp_ranks_write_and_fresh_processes_read_every_page(daemon, cache_prefix, model):
    before = daemon.requests_by_method()
    job = {"socket": daemon.target, "model": model, "prefix": cache_prefix, "tp_size": 2}
    writers = _results([_rank({**job, "tp_rank": r, "job": "write"}) for r in (0, 1)])
    assert writers[0] == {"mha": {"set": [True] * 6}, "mla": {"set": [True] * 6}}
    assert writers[1] == {"mha": {"set": [True] * 6}, "mla": {"set": []}}  # not an MLA storage writer
    (readers,) = _results([_rank({**job, "tp_ranks": [0, 1], "job": "read"})])
    for rank in ("0", "1"):
        for kind in ("mha", "mla"):
            # Each rank reads its own MHA heads (rank 1 its own seed's bytes) and rank 0's MLA latent.
            assert readers[rank][kind] == {"get": [True] * 6, "exact": [True] * 6, "exists": 6}, (rank, kind)
    after = daemon.requests_by_method()
    # The daemon counted the SGLang sessions' calls as any session's (its metrics, per method).
    for method in ("Save", "Load", "Lookup"):
        assert after.get(method, 0) > before.get(method, 0), method


def test_a_pool_truncated_under_transfers_kills_only_its_engine(daemon, cache_prefix, model):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool

    proc = _rank({"socket": daemon.target, "model": model, "prefix": cache_prefix, "tp_size": 1, "tp_rank": 0,
                  "job": "truncate"})  # fmt: skip
    _, stderr = proc.communicate(timeout=RANK_TIMEOUT_S)
    # The engine's own copy out of its truncated pool faults; the daemon never mapped that pool.
    assert proc.returncode == -signal.SIGBUS, stderr[-3000:]
    assert daemon.alive()
    extra = extra_config(daemon.target, cache_prefix=cache_prefix + "-other")
    pool = host_pool("mha", "page_first")
    fill(pool, 3)
    other = backend(pool, model, extra)
    try:
        keys = [f"{0xC0 + i:064x}" for i in range(2)]
        assert other.batch_set_v1(keys, torch.arange(0, 2 * PAGE)) == [True, True]
        assert other.batch_get_v1(keys, torch.arange(4 * PAGE, 6 * PAGE)) == [True, True]
        assert torch.equal(pool.get_data_page(0).view(torch.uint8), pool.get_data_page(4 * PAGE).view(torch.uint8))
    finally:
        other.close()
    assert daemon.status(quiet=True).returncode == 0


def test_the_daemon_refuses_sglangs_pool_memfd_itself(daemon, cache_prefix, model):
    # Why the backend stages: registering SGLang's own memfd is refused (it can never be sealed against shrinking).
    from pools import host_pool

    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient
    from kvsidecar_client.errors import InvalidRequest
    from kvsidecar_client.memory import Segment, _segments, _segments_lock

    pool = host_pool("mha", "page_first")
    view = pool.kv_buffer[0].unflatten(0, (pool.page_num, pool.page_size))
    client = SidecarClient.connect(daemon.target, model=model, layout=EngineLayout(), num_kv_heads=2,
                                   hash_block_size=pool.page_size, groups=[GroupSpec("full_attention", 4)],
                                   cache_prefix=cache_prefix)  # fmt: skip
    base = view.untyped_storage().data_ptr()
    with _segments_lock:
        _segments[base] = Segment("", os.fstat(pool.fd).st_size, pool.fd)
    try:
        with pytest.raises(InvalidRequest, match="not sealed against shrinking"):
            client.register([view], [(0,)])
    finally:
        with _segments_lock:
            _segments.pop(base, None)
        client.close()


def test_a_second_tenant_gets_nothing(daemon, cache_prefix, model, tmp_path):
    import torch
    from pools import PAGE, backend, extra_config, fill, host_pool
    from sidecar_daemon import Daemon

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
        # Another tenant's namespace (its cache prefix) holds none of it.
        assert theirs.batch_exists(keys) == 0
        assert theirs.batch_get_v1(keys, torch.arange(8 * PAGE, 11 * PAGE)) == [False] * 3
    finally:
        mine.close()
        theirs.close()
    # With a tenants file, a prefix the tenant was not granted is refused at attach: rights are off unless granted.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alpha]\nuids = [{os.getuid()}]\nprefixes = ["alpha"]\n')
    guarded = Daemon(tmp_path / "d", extra=("--tenants", str(tenants), "--trust-local-accounts"))
    (tmp_path / "d").mkdir()
    guarded.start()
    try:
        with pytest.raises(PermissionDenied):
            backend(host_pool("mha", "page_first"), model, extra_config(guarded.target, cache_prefix="beta"))
    finally:
        guarded.stop()
