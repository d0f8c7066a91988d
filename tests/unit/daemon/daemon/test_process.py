"""The daemon over the in-memory store keeps what it has over Mooncake: its fence, its disk tier, their reports."""

from __future__ import annotations

import grpc

from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tiers.directory import SsdDirLock
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc
from support.inprocess import InProcessDaemon


def test_a_daemon_on_the_double_keeps_its_fence_and_disk_tier(tmp_path):
    ssd = tmp_path / "ssd"
    d = InProcessDaemon(tmp_path, MemoryStore(), ssd_dir=str(ssd)).start()
    try:
        daemon = d.daemon
        assert daemon is not None and daemon.disk_tier is not None
        assert (ssd / "kvsidecar.lock").exists()  # the directory is claimed, as over Mooncake
        with grpc.insecure_channel(d.target) as channel:
            stats = pb_grpc.SidecarStub(channel).Stats(pb.StatsRequest(), timeout=10)
        # The fence reports every listener of the daemon, kvsidecar's own included, through Stats and metrics.
        roles = {item.role for item in stats.listeners}
        assert {"grpc-unix", "metrics"} <= roles
        unix = next(item for item in stats.listeners if item.role == "grpc-unix")
        assert d.sample(
            "kvsidecar_listener_info", {"role": "grpc-unix", "address": unix.address, "allowed": unix.allowed}
        )
        # The disk tier's recovery reached the store's health through the store's own interface.
        assert "disk tier" in stats.store_detail and "recovered 0 blocks" in stats.store_detail
    finally:
        d.stop()
    SsdDirLock.claim(str(ssd)).release()  # the daemon let go of the directory when it stopped
