"""Two to four daemons, one master, each node in its own network namespace: every byte crosses Mooncake's real TCP
transport between processes, and Mooncake's ports answer only the named peer network."""

from __future__ import annotations

import dataclasses
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import (
    A_IP,
    B_IP,
    C_IP,
    CLIENT_TTL_S,
    MANIFEST,
    OUTSIDE_IP,
    PEERS,
    Master,
    daemon_flags,
    daemons_on_a_and_b,
)
from netns import Fabric, Node
from nodes import NodeDaemon, listener_filters

from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, Parallel, block_key, key_prefix
from kvsidecar_testing.oracle import Prompt
from kvsidecar_testing.ranks import RankProcess
from support import e2e_rank
from support.e2e_engine import GQA, MAMBA_CONV, MAMBA_SSM, MLA, SimEngine, cold_pass, scheduler, unique_model, warm_pass

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
HYBRID = (GroupSpec(Kind.MLA, 16), GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
TENSORS = [MLA, GQA, dataclasses.replace(MAMBA_CONV, group=2), dataclasses.replace(MAMBA_SSM, group=2)]


def hybrid(name: str) -> Layout:
    return Layout(unique_model(name), HYBRID, Parallel(2), num_kv_heads=2)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RankProcess]]:
    """Four rank processes in the root namespace: the engine on A uses 0-1, the one on B 2-3."""
    with e2e_rank.started(tmp_path_factory.mktemp("cluster-ranks"), 4) as procs:
        yield procs


@pytest.fixture(scope="module")
def nodes(fabric: Fabric, master: Master, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeDaemon]]:
    """Daemons on nodes A and B (in the peer network), each contributing a 16 MiB segment."""
    with daemons_on_a_and_b(fabric, master, tmp_path_factory.mktemp("cluster-daemons")) as started:
        yield started


def engine_on(daemon: NodeDaemon, procs: list[RankProcess], layout: Layout) -> SimEngine:
    return SimEngine(procs, f"unix://{daemon.socket}", layout, TENSORS).open()


def locations(master: Master) -> dict[str, str]:
    """Every key in the cluster -> the transport endpoint of the segment holding its (one) replica."""
    out = {}
    for key in master.admin("/get_all_keys").split():
        try:
            replicas = master.admin(f"/query_key?key={key}")["data"]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # removed between the listing and the query (a dead node's values going away)
                continue
            raise
        out[key] = ",".join(sorted(str(r) for r in replicas))
    return out


def endpoint_ip(replicas: str) -> str:
    return replicas.split("'transport_endpoint_': '", 1)[1].split(":", 1)[0]


def key_model(layout: Layout) -> str:
    """The start of every key of the layout's model under its cache prefix (any value id)."""
    return key_prefix(layout.model, layout.cache_prefix)


def lookup(daemon: NodeDaemon, layout: Layout, prompt: Prompt):  # type: ignore[no-untyped-def]
    client = scheduler(f"unix://{daemon.socket}", layout)
    try:
        return client.lookup(prompt.hashes, prompt.num_tokens)
    finally:
        client.close()


def probe(node: Node, targets: list[str]) -> list[dict[str, str]]:
    """A plain TCP client in node's namespace: connect (and send nothing readable) to each target."""
    out = node.run([sys.executable, str(HERE / "rawprobe.py"), "0", "0", *targets], timeout=120)
    assert out.returncode == 0, out.stderr
    return [__import__("json").loads(line) for line in out.stdout.splitlines()]


def never_wrong_bytes(engine: SimEngine, prompt: Prompt, hit_tokens: int) -> None:
    """Every block holds what the oracle says after the load, or still the poison of a cleared block."""
    from kvsidecar_testing.oracle import POISON, digest

    found = engine.digests()
    problems = engine.verify(prompt, hit_tokens)
    for line in problems:
        rank, tensor, block = _where(line)
        poison = digest(bytes([POISON]) * engine.tensors[tensor].block_bytes)
        assert found[rank][tensor][block] == poison, f"wrong bytes, not a failed load: {line}"


def _where(problem: str) -> tuple[int, int, int]:
    # "rank RankId(tp=0, ...) tensor 2 (group 2) block 31: want ..."
    head = problem.split(":", 1)[0]
    tp = int(head.split("tp=", 1)[1].split(",", 1)[0])
    tensor = int(head.split(" tensor ", 1)[1].split(" ", 1)[0])
    block = int(head.rsplit(" block ", 1)[1])
    return tp, tensor, block


def test_overlay_flags_are_the_ones_the_cluster_uses(master, fabric):
    (container,) = yaml.safe_load(MANIFEST.read_text())["spec"]["template"]["spec"]["containers"]
    manifest = {a for a in container["args"] if a.startswith("--")} - {"--config"}
    used = {a for a in daemon_flags(master, Node("", "10.0.0.1")) if a.startswith("--")}
    # The ConfigMap's segment-size and metrics-address are replaced by a small segment and a free loopback port.
    assert manifest == used - {"--segment-size", "--metrics-address"}, (manifest, used)


def test_hybrid_prompt_saved_on_a_loads_byte_identical_on_b(nodes, ranks, master):
    layout = hybrid("a-to-b")
    on_a = engine_on(nodes["a"], ranks[:2], layout)
    on_b = engine_on(nodes["b"], ranks[2:], layout)
    prompt = Prompt(layout.model, 65, 16)
    cold_pass(on_a, prompt)
    ours = {k: v for k, v in locations(master).items() if k.startswith(key_model(layout))}
    assert ours, "the save stored nothing?"
    hit = lookup(nodes["b"], layout, prompt)
    assert (hit.hit_tokens, hit.degraded) == (64, False), hit
    warm_pass(on_b, prompt, hit)  # every block of both ranks, against the oracle
    # Mooncake placed values on both nodes: B read A's segment over TCP, from another namespace.
    assert {endpoint_ip(v) for v in ours.values()} == {A_IP, B_IP}, ours
    on_a.close()
    on_b.close()


def test_only_the_peer_network_reaches_mooncakes_ports(nodes, fabric, master, tmp_path):
    a = nodes["a"]
    fenced = [item for item in a.status()["listeners"] if item["role"].startswith("mooncake-")]
    assert fenced and all(item["allowed"] == f"127.0.0.0/8,::1/128,{PEERS}" for item in fenced), fenced
    targets = [f"{A_IP}:{item['address'].rsplit(':', 1)[1]}" for item in fenced]
    # Every listener of A's daemon process is loopback-bound or carries the fence, seen from outside the process.
    assert all(program for s, program in listener_filters(a.pid) if not s.local.is_loopback)
    before = {item["address"]: int(item["dropped_packets"]) for item in fenced}

    outside = fabric.add(int(OUTSIDE_IP.rsplit(".", 1)[1]))
    assert {r["outcome"] for r in probe(outside, targets)} == {"connect timed out"}
    named = next(n for n in fabric.nodes if n.address == B_IP)
    assert {r["outcome"] for r in probe(named, targets)} == {"connected"}

    # A daemon on C joins the same master but is not in A's peer network: from its namespace A's ports are dark.
    # (Its Mooncake client would wait on the dropped SYNs until its own connect timeout: a misconfigured peer
    # shows up as slow failed loads and as refused packets on A, never as a connection.)
    c_node = fabric.add(int(C_IP.rsplit(".", 1)[1]))
    c = NodeDaemon(tmp_path, daemon_flags(master, c_node, segment="0"), c_node, "c").start()
    try:
        assert {r["outcome"] for r in probe(c_node, targets)} == {"connect timed out"}
    finally:
        assert c.stop() == 0, c.log()
    after = {
        i["address"]: int(i["dropped_packets"]) for i in a.status()["listeners"] if i["role"].startswith("mooncake-")
    }
    assert sum(after.values()) > sum(before.values()), (before, after)  # the refused SYNs, counted


def test_the_cluster_holds_more_than_any_one_segment(nodes, ranks, master):
    """Three prompts of 6 MiB each through A: 18 MiB, more than one 16 MiB segment, spread over both; B loads all."""
    big = dataclasses.replace(GQA, group=0, block_shape=(2, 16, 8, 512))  # 256 KiB per block
    layout = Layout(unique_model("capacity"), (GroupSpec(Kind.FULL_ATTENTION, 16),), Parallel(1), num_kv_heads=1)
    on_a = SimEngine(ranks[:1], f"unix://{nodes['a'].socket}", layout, [big]).open()
    on_b = SimEngine(ranks[2:3], f"unix://{nodes['b'].socket}", layout, [big]).open()
    prompts = [Prompt(f"{layout.model}#{i}", 24 * 16 + 1, 16) for i in range(3)]
    for prompt in prompts:
        cold_pass(on_a, prompt)
    used = {name: s["allocator_used_bytes"] for name, s in master.segments().items()}
    assert sum(used.values()) > 16 << 20 and len(used) == 2 and all(used.values()), used
    for prompt in prompts:
        hit = lookup(nodes["b"], layout, prompt)
        assert hit.hit_tokens == 24 * 16, hit
        warm_pass(on_b, prompt, hit)
    on_a.close()
    on_b.close()


def test_a_killed_node_fails_its_blocks_and_the_master_forgets_them(nodes, ranks, master):
    layout = hybrid("kill-a")
    on_a = engine_on(nodes["a"], ranks[:2], layout)
    on_b = engine_on(nodes["b"], ranks[2:], layout)
    prompt = Prompt(layout.model, 65, 16)
    cold_pass(on_a, prompt)
    where = {k: endpoint_ip(v) for k, v in locations(master).items() if k.startswith(key_model(layout))}
    only_in_a = {k for k, ip in where.items() if ip == A_IP}
    assert only_in_a and len(only_in_a) < len(where), where
    hit = lookup(nodes["b"], layout, prompt)
    assert hit.hit_tokens == 64

    nodes["a"].kill()  # -9: no goodbye to the master
    on_b.clear()
    loads = on_b.load(prompt, hit)
    failed = sum(len(r["failures"]) for r in loads)
    loaded = sum(r["loaded"] for r in loads)
    assert failed > 0 and loaded > 0, loads  # A's values fail, B's load
    # Exactly values that lived only in A's segment failed: map each failure back to its key.
    warm_top = on_b.warm_ids(prompt)[0][0]
    failed_keys = {
        block_key(Geometry.of(layout.for_rank(rank)).groups[f["group"]].prefix, prompt.hashes[warm_top - f["block_id"]])
        for rank, result in enumerate(loads)
        for f in result["failures"]
    }
    assert failed_keys <= only_in_a, failed_keys - only_in_a
    never_wrong_bytes(on_b, prompt, hit.hit_tokens)

    # After the master's client TTL, A's segment and every value in it are gone; B's values stay.
    deadline = time.monotonic() + 10 * CLIENT_TTL_S + 20
    while set(locations(master)) & only_in_a:
        assert time.monotonic() < deadline, "the master still lists values of the dead node"
        time.sleep(0.5)
    remaining = {k for k in locations(master) if k.startswith(key_model(layout))}
    assert remaining == set(where) - only_in_a
    after = lookup(nodes["b"], layout, prompt)
    last_block = prompt.hashes[-1].hex()
    if any(last_block in k for k in only_in_a):
        assert after.hit_tokens < 64, after
    if after.hit_tokens:
        warm_pass(on_b, prompt, after)  # what lookups still report loads in full, byte for byte
    on_b.close()
