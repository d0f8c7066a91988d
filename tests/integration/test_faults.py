"""Faults with real processes, killed for real: a full store, leases, a daemon crash, a rank crash."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store import StoreCode
from kvsidecar_client import DaemonUnavailable, EngineLayout, SidecarClient, shared_tensor
from kvsidecar_client import GroupSpec as ClientGroup
from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, block_key
from kvsidecar_testing.processes import DaemonProcess, StorageNode
from kvsidecar_testing.waiting import wait_until
from support.rawrank import RawRank, group, open_request

pytestmark = pytest.mark.integration

MiB = 1 << 20


def hashes(n: int, salt: int) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(32, "big") for i in range(n)]


def metric(daemon: DaemonProcess, line_prefix: str) -> float:
    body = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(line_prefix)]
    return sum(values)


@pytest.fixture
def own_master():
    master = EmbeddedMaster(lease_ttl_ms=1000).start()
    yield master
    master.stop()


def test_full_store_fails_saves_softly_and_keeps_serving(own_master, tmp_path):
    daemon = DaemonProcess(
        tmp_path, allow_shm_names=True, master=own_master.address, extra=("--segment-size", "16MiB")
    ).start()
    rank = RawRank(daemon.target, open_request([group("mla", 16)], model="org/Full"), num_blocks=48, block_bytes=MiB)
    try:
        rank.register()
        for b in range(48):
            rank.fill_block(0, b, bytes([b + 1]) * MiB)
        first = hashes(4, 1)
        assert rank.save(first, [[0, 1, 2, 3]], 64).written == 4
        hit = rank.lookup(first, 65)
        assert hit.hit_tokens == 64
        big = hashes(40, 2)
        out = rank.save(big, [list(range(4, 44))], 40 * 16)
        assert out.failed > 0 and {f.reason for f in out.failures} == {"no_space"}
        assert metric(daemon, 'kvsidecar_save_failed_blocks_total{group_kind="mla",reason="no_space"}') > 0
        # Lookups and loads keep working: the hit's blocks either load byte-exact or are named as failed.
        again = rank.lookup(first, 65)
        loaded = rank.load(first, [[44, 45, 46, 47]], again)
        failed = {f.block_id for f in loaded.failures}
        for i, b in enumerate((44, 45, 46, 47)):
            if b not in failed:
                assert rank.block(0, b) == bytes([i + 1]) * MiB
        assert daemon.serving()
    finally:
        rank.close()
        assert daemon.stop() == 0, daemon.log()[-2000:]


def test_a_hit_is_protected_by_its_lease_until_the_load(own_master, tmp_path, connect_mooncake, mooncake_settings):
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=own_master.address).start()
    rank = RawRank(daemon.target, open_request([group("full_attention", 16)], model="org/Lease"), 8, 4096)
    other = connect_mooncake(mooncake_settings(own_master, global_segment_size=0))
    try:
        rank.register()
        rank.fill_block(0, 0, b"L" * 4096)
        h = hashes(1, 3)
        assert rank.save(h, [[0]], 16).written == 1
        hit = rank.lookup(h, 17)  # the existence check takes a lease (1 s on this master)
        assert hit.hit_tokens == 16
        geo = Geometry.of(Layout("org/Lease", (GroupSpec(Kind.FULL_ATTENTION, 16),)))
        key = block_key(geo.groups[0].prefix, h[0])
        assert other.remove([key], force=False) == [StoreCode.LEASED]  # eviction cannot take it either
        assert not rank.load(h, [[1]], hit).failures
        assert rank.block(0, 1) == b"L" * 4096
        time.sleep(1.5)  # the lease (renewed by the load's read) runs out
        assert other.remove([key], force=False) == [StoreCode.OK]
        late = rank.load(h, [[2]], hit)  # a load after the value is gone says so, and writes nothing
        assert [(f.block_id, f.reason) for f in late.failures] == [(2, "not_found")]
        assert rank.block(0, 2) == bytes(4096)
    finally:
        rank.close()
        assert daemon.stop() == 0


def test_a_load_outlasts_a_master_paused_past_its_rpc_timeout(own_master, tmp_path):
    """A busy master (here a paused one) answers a load's reads after the client's RPC timeout: the load tries again
    within its deadline, and the blocks its lookup promised are served, not recomputed."""
    rpc_timeout = {"MC_RPC_TIMEOUT_MS": "1000"}  # the daemon's 5 s, shortened: the pause only has to outlast it
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=own_master.address, env=rpc_timeout).start()
    rank = RawRank(daemon.target, open_request([group("full_attention", 16)], model="org/Paused"), 8, 4096)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        rank.register()
        for b in range(4):
            rank.fill_block(0, b, bytes([b + 1]) * 4096)
        h = hashes(4, 7)
        assert rank.save(h, [[0, 1, 2, 3]], 64).written == 4
        hit = rank.lookup(h, 65)
        assert hit.hit_tokens == 64
        retries = lambda: daemon.metric_samples("kvsidecar_store_retries_total", "reason").get("rpc_timeout", 0)  # noqa: E731
        os.kill(own_master.pid, signal.SIGSTOP)
        try:
            loading = pool.submit(rank.load, h, [[4, 5, 6, 7]], hit)
            # The first read timed out and the load is in its retry window: the master comes back.
            wait_until(lambda: retries() >= 4 or loading.done(), timeout=60, what="a retry", detail=daemon.log)
        finally:
            os.kill(own_master.pid, signal.SIGCONT)
        loaded = loading.result(timeout=60)
        assert not loaded.failures and loaded.loaded == 4, daemon.log()[-3000:]
        assert [rank.block(0, b) for b in (4, 5, 6, 7)] == [bytes([b + 1]) * 4096 for b in range(4)]
    finally:
        pool.shutdown()
        rank.close()
        assert daemon.stop() == 0


def test_daemon_killed_mid_save_clients_reconnect_and_old_blocks_still_hit(own_master, tmp_path):
    node = StorageNode(own_master.address, tmp_path).start()
    daemon_args = ("--segment-size", "0")  # the storage node holds the data, so it outlives the daemon
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=own_master.address, extra=daemon_args).start()
    kv = shared_tensor((64, 16, 512), torch.float32)  # 32 KiB blocks
    client = SidecarClient.connect(
        daemon.target, model="org/Crash", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
        groups=[ClientGroup("full_attention", block_size=16)],
    )  # fmt: skip
    try:
        client.register([kv], groups_of_tensor=[(0,)])
        for b in range(64):
            kv[b].fill_(float(b + 1))
        early = hashes(8, 4)
        assert client.save(early, [list(range(8))], 128).result(timeout=30).written == 8
        before = client.lookup(early, 129)
        assert before.hit_tokens == 128
        late = hashes(48, 5)
        job = client.save(late, [list(range(8, 56))], 48 * 16)
        daemon.kill()  # -9, possibly in the middle of that save
        started = time.monotonic()
        with contextlib.suppress(DaemonUnavailable):  # a save may also have completed before the kill: both fine
            job.result(timeout=30)
        assert time.monotonic() - started < 30
        miss = client.lookup(early, 129)
        assert miss.hit_tokens == 0 and miss.degraded  # fails fast while the daemon is down
        with pytest.raises(DaemonUnavailable):
            client.load(early, [list(range(56, 64))], before)

        daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=own_master.address, extra=daemon_args).start()
        seen = []

        def full_hit():
            seen.append(hit := client.lookup(early, 129))
            return hit if hit.hit_tokens == 128 else None

        hit = wait_until(full_hit, timeout=30, what="reconnect", detail=lambda: f"no reconnect: {seen[-1]}")
        kv[56:64].zero_()
        assert client.load(early, [list(range(56, 64))], hit) == set()
        assert all(bool((kv[56 + i] == float(i + 1)).all()) for i in range(8))
    finally:
        client.close()
        daemon.stop()
        node.stop()


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
    client = SidecarClient.connect(sys.argv[1], model="org/Doomed", layout=EngineLayout(), num_kv_heads=1,
                                   hash_block_size=16, groups=[GroupSpec("mla", block_size=16)])
    kv = shared_tensor((32, 16, 64), torch.float32)
    client.register([kv], groups_of_tensor=[(0,)])
    print("registered", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_rank_is_released_within_its_lease(mooncake_master, tmp_path):
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=mooncake_master.address, session_ttl=3).start()
    survivor = SidecarClient.connect(  # a live rank: its client keeps its lease
        daemon.target, model="org/Survivor", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
        groups=[ClientGroup("mla", block_size=16)],
    )  # fmt: skip
    kv = shared_tensor((4, 16, 16), torch.float32)
    doomed = subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, daemon.target], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        survivor.register([kv], groups_of_tensor=[(0,)])
        assert doomed.stdout is not None and doomed.stdout.readline().strip() == b"registered"
        assert metric(daemon, 'kvsidecar_sessions{role="rank"}') == 2
        survivor_bytes = kv.numel() * 4
        doomed_bytes = 32 * 16 * 64 * 4
        assert metric(daemon, "kvsidecar_registered_region_bytes") == survivor_bytes + doomed_bytes
        os.kill(doomed.pid, 9)
        doomed.wait(10)
        # The lease is 3 s, housekeeping runs every second.
        released = lambda: metric(daemon, 'kvsidecar_sessions{role="rank"}') == 1  # noqa: E731
        wait_until(released, timeout=10, what="the killed rank released", detail=lambda: daemon.log()[-2000:])
        assert metric(daemon, "kvsidecar_registered_region_bytes") == survivor_bytes
        kv.fill_(3.0)
        h = hashes(1, 6)
        assert survivor.save(h, [[0]], 16).result(timeout=30).written == 1
        assert survivor.lookup(h, 17).hit_tokens == 16
    finally:
        if doomed.poll() is None:
            doomed.kill()
        survivor.close()
        assert daemon.stop() == 0


def test_master_killed_during_traffic_no_wrong_bytes_and_recovery(tmp_path):
    from kvsidecar_testing.processes import free_port

    master = EmbeddedMaster(rpc_port=free_port(), metrics_port=free_port()).start()
    daemon = DaemonProcess(tmp_path, allow_shm_names=True, master=master.address).start()
    kv = shared_tensor((64, 16, 256), torch.float32)  # 16 KiB blocks: 0..31 saved from, 32..63 loaded into
    client = SidecarClient.connect(
        daemon.target, model="org/Traffic", layout=EngineLayout(), num_kv_heads=1, hash_block_size=16,
        groups=[ClientGroup("full_attention", block_size=16)],
    )  # fmt: skip
    stats = {"rounds": 0, "verified": 0, "failed_blocks": 0, "degraded": 0, "save_errors": 0}
    try:
        client.register([kv], groups_of_tensor=[(0,)])

        def one_round(i: int) -> None:
            h = hashes(4, 100 + i)
            for b in range(4):
                kv[b].fill_(float(i * 10 + b + 1))
            try:
                client.save(h, [[0, 1, 2, 3]], 64).result(timeout=30)
            except DaemonUnavailable:
                stats["save_errors"] += 1
            hit = client.lookup(h, 65)
            stats["degraded"] += hit.degraded
            kv[32:36].fill_(-1.0)
            failed = client.load(h, [[32, 33, 34, 35]], hit) if hit.hit_tokens else set()
            stats["failed_blocks"] += len(failed)
            for b in range(hit.hit_tokens // 16):
                if 32 + b not in failed:  # every block not named as failed holds exactly the saved bytes
                    assert bool((kv[32 + b] == float(i * 10 + b + 1)).all()), (i, b)
                    stats["verified"] += 1
            stats["rounds"] += 1

        started = time.monotonic()
        for i in range(4):
            one_round(i)
        os.kill(master.pid, 9)
        for i in range(4, 6):
            one_round(i)
        assert time.monotonic() - started < 90, "requests hung while the master was down"
        master.restart()
        deadline = time.monotonic() + 30
        recovered = False
        while not recovered and time.monotonic() < deadline:
            before = stats["verified"]
            one_round(stats["rounds"])
            recovered = stats["verified"] == before + 4
        assert recovered, (stats, daemon.log()[-3000:])
        assert stats["degraded"] > 0  # the outage was seen, and said
    finally:
        client.close()
        assert daemon.stop() == 0
        master.stop()
