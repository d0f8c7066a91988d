"""A default `kvsidecar serve` from outside: no listener of the daemon or its master answers another namespace.

The daemon runs its master and Mooncake in a private network namespace (its loopback guard): from the host's
namespace, loopback included, their ports are not there at all. Inside that namespace (entered with nsenter, as only
root can) the fence still drops every packet to Mooncake's ports: two guards, each tested alone.

The probe is the raw 24-byte READ header of Mooncake's transfer protocol; a bare Mooncake client shows it works
(it reads the client's bytes back), so the same probe coming back empty from the daemon means the fence holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Fabric, Node, free_subnet, require_root
from nodes import KVSIDECAR, NamespaceOf, NodeDaemon, children, listener_filters

from kvsidecar.fence import bpf, proctcp

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
DENY_ALL = bpf.encode(bpf.allow_program([]))


@pytest.fixture(scope="module")
def fabric() -> Iterator[Fabric]:
    require_root()
    with Fabric(free_subnet(range(150, 200))) as f:
        f.add()
        yield f


@pytest.fixture(scope="module")
def outside(fabric: Fabric) -> Node:
    return fabric.nodes[0]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, fabric: Fabric) -> Iterator[NodeDaemon]:
    """The README's command, with a small segment: embedded master, TCP, P2PHANDSHAKE."""
    d = NodeDaemon(
        tmp_path_factory.mktemp("single-node"), ["--segment-size", "16MiB", "--metrics-address", "127.0.0.1:0"]
    )
    d.start()
    yield d
    assert d.stop() == 0, d.log()


def probe(node: Node, address: int, targets: list[str]) -> list[dict[str, str]]:
    out = node.run([sys.executable, str(HERE / "rawprobe.py"), str(address), "32", *targets], timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def master_of(d: NodeDaemon) -> int:
    (pid,) = children(d.pid)
    return pid


def master_port(d: NodeDaemon, flag: str) -> str:
    args = Path(f"/proc/{master_of(d)}/cmdline").read_bytes().split(b"\0")
    return next(a.split(b"=")[1].decode() for a in args if a.startswith(f"--{flag}=".encode()))


def segment_base(d: NodeDaemon) -> int:
    """The daemon's segment (a registered buffer), as its master's admin HTTP tells whoever shares its namespace."""
    url = f"http://127.0.0.1:{master_port(d, 'metrics_port')}/get_segments_detail"
    fetch = f"import urllib.request, sys; sys.stdout.write(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    out = NamespaceOf(d.pid).run([sys.executable, "-c", fetch], timeout=60)
    assert out.returncode == 0, out.stderr
    (segment,) = json.loads(out.stdout)["segments"]
    return int(segment["base_address"], 16)


def test_the_probe_reads_a_bare_mooncake_clients_memory(tmp_path, fabric, outside, mooncake_master):
    """Positive control: without kvsidecar's fence, another namespace reads registered memory verbatim."""
    client = subprocess.Popen(
        [sys.executable, str(HERE / "exposed_client.py"), mooncake_master.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"},
    )
    try:
        assert client.stdout is not None
        info = json.loads(client.stdout.readline())
        results = probe(outside, info["address"], [f"{fabric.host}:{port}" for port in info["ports"]])
        leaked = [r for r in results if r["bytes"]]
        assert leaked and bytes.fromhex(leaked[0]["bytes"]) == bytes(range(0xA0, 0xC0)), results
    finally:
        assert client.stdin is not None
        client.stdin.close()
        client.wait(30)


def test_saves_and_loads_work_with_mooncakes_ports_closed_to_everyone(daemon):
    """The only node reaches its own segment by memcpy: the demo's bytes round-trip and no packet hits the fence."""
    demo = subprocess.run([*KVSIDECAR, "demo", "--socket", daemon.socket], capture_output=True, text=True, timeout=180)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "0 mismatches" in demo.stdout
    listeners = daemon.status()["listeners"]
    fenced = [item for item in listeners if item["role"].startswith("mooncake-")]
    assert {item["role"] for item in fenced} == {"mooncake-transfer", "mooncake-handshake"}, listeners
    assert all(item["allowed"] == "nobody" for item in fenced)
    # Mooncake never used its ports: not one packet, loopback included, reached the fence during the demo.
    assert all(int(item["dropped_packets"]) == 0 for item in fenced), fenced


def test_every_listener_of_the_daemon_and_its_master_is_loopback_bound_or_fenced(daemon):
    for pid in (daemon.pid, master_of(daemon)):
        found = listener_filters(pid)
        assert found, f"PID {pid} has no TCP listener at all?"
        for s, program in found:
            assert proctcp.is_loopback_bound(s) or program == DENY_ALL, f"PID {pid}: {s.endpoint} is open"
    master_listeners = [s for s, _ in listener_filters(master_of(daemon))]
    assert all(proctcp.is_loopback_bound(s) for s in master_listeners), master_listeners


def test_no_listener_answers_the_raw_read_from_another_namespace(daemon, fabric, outside):
    base = segment_base(daemon)
    ports = sorted({s.local_port for pid in (daemon.pid, master_of(daemon)) for s, _ in proctcp.listeners(pid)})
    results = probe(outside, base, [f"{fabric.host}:{port}" for port in ports])
    assert len(results) == len(ports) >= 4
    for r in results:
        assert r["bytes"] == "" and r["outcome"] != "connected", r
    # The fenced ports drop the SYNs (the peer times out); the loopback ones are not bound where it knocks.
    outcomes = {r["outcome"] for r in results}
    assert outcomes <= {"connect timed out", "connect failed: Connection refused"}, results


def test_local_accounts_reach_none_of_the_ports_on_the_hosts_loopback(daemon):
    """The master's and Mooncake's ports live in the daemon's private namespace: refused on this host's loopback."""
    ports = sorted({s.local_port for pid in (daemon.pid, master_of(daemon)) for s, _ in proctcp.listeners(pid)})
    results = probe(Node("", ""), segment_base(daemon), [f"127.0.0.1:{port}" for port in ports])
    assert len(results) == len(ports) >= 4
    assert all(r["outcome"] == "connect failed: Connection refused" and r["bytes"] == "" for r in results), results


def test_inside_the_daemons_namespace_the_fence_still_drops_every_packet(daemon):
    """Were the namespace shared, the fence would still hold Mooncake's ports: SYNs dropped and counted."""
    ports = [s.local_port for s, program in listener_filters(daemon.pid) if program == DENY_ALL]
    assert len(ports) == 2
    results = probe(NamespaceOf(daemon.pid), segment_base(daemon), [f"127.0.0.1:{port}" for port in ports])
    assert all(r["outcome"] == "connect timed out" and r["bytes"] == "" for r in results), results
    fenced = [item for item in daemon.status()["listeners"] if item["role"].startswith("mooncake-")]
    assert all(int(item["dropped_packets"]) > 0 for item in fenced), fenced


def test_a_mooncake_client_mounting_a_segment_in_the_daemons_namespace_stops_the_daemon(tmp_path):
    """Behind the guard, only root entering the daemon's namespace can reach its master; a client there mounting a
    segment would receive some of the daemon's blocks: the daemon fails closed."""
    d = NodeDaemon(tmp_path, ["--segment-size", "16MiB", "--metrics-address", "127.0.0.1:0"]).start()
    rpc = master_port(d, "rpc_port")
    rogue = NamespaceOf(d.pid).popen(
        [sys.executable, str(HERE / "exposed_client.py"), f"127.0.0.1:{rpc}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"},
    )
    try:
        assert d.proc is not None
        assert d.proc.wait(60) == 1, d.log()
        assert "mounted a segment at the embedded master" in d.log()
    finally:
        assert rogue.stdin is not None
        rogue.stdin.close()
        rogue.wait(30)
        d.stop()
