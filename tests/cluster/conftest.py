"""A Mooncake cluster on one machine: a master and daemons, each in its own network namespace on one bridge."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import Fabric, Node, free_subnet, require_root
from nodes import NodeDaemon

from kvsidecar.daemon.master import find_master_binary

# A subnet of its own per run, so two runs on one machine never share addresses.
SUBNET = free_subnet(range(200, 250))
PEERS = f"{SUBNET}.8/29"  # the cluster's nodes: .8-.15
MASTER_IP, A_IP, B_IP = f"{SUBNET}.10", f"{SUBNET}.11", f"{SUBNET}.12"
C_IP, OUTSIDE_IP = f"{SUBNET}.20", f"{SUBNET}.30"  # a daemon and a plain client outside the peer network
RPC_PORT, METADATA_PORT, ADMIN_PORT = 50051, 8080, 9003
CLIENT_TTL_S = 2
SEGMENT = "16MiB"  # Mooncake's minimum


@dataclass
class Master:
    """mooncake_master in its own namespace: RPC and HTTP metadata on the bridge (its admin port too, for tests)."""

    node: Node
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{self.node.address}:{RPC_PORT}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.node.address}:{METADATA_PORT}/metadata"

    def admin(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://{self.node.address}:{ADMIN_PORT}{path}", timeout=5) as reply:
            body = reply.read().decode()
        return json.loads(body) if body.startswith("{") else body

    def segments(self) -> dict[str, dict[str, Any]]:
        """Segment name -> its detail (allocator bytes used, capacity)."""
        return {s["segment_name"]: s for s in self.admin("/get_segments_detail")["segments"]}


@pytest.fixture(scope="module")
def fabric() -> Iterator[Fabric]:
    require_root()
    with Fabric(SUBNET) as f:
        yield f


@pytest.fixture(scope="module")
def master(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    node = fabric.add(10)
    log = tmp_path_factory.mktemp("master") / "master.log"
    argv = [
        str(find_master_binary()),
        f"--rpc_address={node.address}",
        f"--rpc_port={RPC_PORT}",
        f"--metrics_host={node.address}",
        f"--metrics_port={ADMIN_PORT}",
        "--enable_metric_reporting=false",
        "--minloglevel=1",
        f"--client_ttl={CLIENT_TTL_S}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={METADATA_PORT}",
    ]
    with open(log, "ab") as out:
        proc = node.popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    m = Master(node, proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            if m.admin("/health"):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start: {log.read_text(errors='replace')}") from None
            time.sleep(0.1)
    yield m
    proc.terminate()
    proc.wait(20)


def daemon_flags(master: Master, node: Node, segment: str = SEGMENT) -> list[str]:
    """The multi-node overlay's flags (test_overlay_flags checks they are the same ones) with this fabric's values."""
    return [
        "--master", master.address,
        "--metadata-server", master.metadata_url,
        "--local-hostname", node.address,
        "--peer-network", PEERS,
        "--segment-size", segment,
        "--metrics-address", "127.0.0.1:0",
    ]  # fmt: skip


@contextlib.contextmanager
def daemons_on_a_and_b(
    fabric: Fabric, master: Master, workdir: Path, extra: Callable[[str], list[str]] = lambda name: []
) -> Iterator[dict[str, NodeDaemon]]:
    """Daemons on nodes A and B (in the peer network), each contributing a 16 MiB segment, with extra(name) flags."""
    started: dict[str, NodeDaemon] = {}
    try:
        for name, ip in (("a", A_IP), ("b", B_IP)):
            node = fabric.add(int(ip.rsplit(".", 1)[1]))
            started[name] = NodeDaemon(workdir, [*daemon_flags(master, node), *extra(name)], node, name).start()
        yield started
    finally:
        for d in started.values():
            d.stop()


MANIFEST = Path(__file__).parents[2] / "deploy/kubernetes/overlays/multi-node/daemonset-external-master.yaml"
