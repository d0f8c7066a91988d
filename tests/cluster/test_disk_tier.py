"""Disk tiers in a cluster: each daemon writes what it saves to its own disk, and a node's lookups consult only its
own disk besides the shared DRAM pool, so a block on another node's disk alone is not a hit there (docs/ssd-tier.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Master, daemons_on_a_and_b
from netns import Fabric
from nodes import NodeDaemon

from kvsidecar.tiers.records import indexed_keys
from kvsidecar_contract.placement import GroupSpec, Kind, Layout, Parallel
from kvsidecar_testing.oracle import Prompt
from kvsidecar_testing.ranks import RankProcess
from support import e2e_rank
from support.e2e_engine import GQA, SimEngine, cold_pass, scheduler, unique_model, warm_pass

pytestmark = pytest.mark.integration

BIG = dataclasses.replace(GQA, group=0, block_shape=(2, 16, 8, 512))  # 256 KiB per block
BLOCKS = 24  # per prompt: 6 MiB
PROMPTS = 10  # 60 MiB through A, against 32 MiB of DRAM in the cluster


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RankProcess]]:
    """Two rank processes in the root namespace: the engine on A uses 0, the one on B 1."""
    with e2e_rank.started(tmp_path_factory.mktemp("disk-ranks"), 2) as procs:
        yield procs


@pytest.fixture(scope="module")
def nodes(
    fabric: Fabric, master: Master, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[NodeDaemon, Path]]]:
    """Daemons on A and B, each with a 16 MiB segment and a disk tier of its own."""
    workdir = tmp_path_factory.mktemp("disk-daemons")

    def disk_tier(name: str) -> list[str]:
        return ["--ssd-dir", str(workdir / f"ssd-{name}"), "--ssd-size", "256MiB"]

    with daemons_on_a_and_b(fabric, master, workdir, disk_tier) as started:
        yield {name: (d, workdir / f"ssd-{name}") for name, d in started.items()}


def hit_tokens(daemon: NodeDaemon, layout: Layout, prompt: Prompt):  # type: ignore[no-untyped-def]
    client = scheduler(f"unix://{daemon.socket}", layout)
    try:
        return client.lookup(prompt.hashes, prompt.num_tokens)
    finally:
        client.close()


def test_a_block_on_another_nodes_disk_is_not_a_hit_there(nodes, ranks, master):
    (a, ssd_a), (b, ssd_b) = nodes["a"], nodes["b"]
    layout = Layout(unique_model("disk"), (GroupSpec(Kind.FULL_ATTENTION, 16),), Parallel(1), num_kv_heads=1)
    on_a = SimEngine(ranks[:1], f"unix://{a.socket}", layout, [BIG]).open()
    on_b = SimEngine(ranks[1:], f"unix://{b.socket}", layout, [BIG]).open()
    prompts = [Prompt(f"{layout.model}#{i}", BLOCKS * 16 + 1, 16) for i in range(PROMPTS)]
    written = sum(r["written"] for p in prompts for r in cold_pass(on_a, p))
    assert written == PROMPTS * BLOCKS
    # Everything A saved reaches A's disk (written behind); B saved nothing, so its disk holds nothing of it.
    deadline = time.monotonic() + 120
    while len(indexed_keys(ssd_a)) < written and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(indexed_keys(ssd_a)) == written
    assert not [k for k in indexed_keys(ssd_b) if layout.model in k]
    # The shared DRAM pool (2 x 16 MiB) cannot hold the 60 MiB: the master forgot some of it.
    assert len([k for k in master.admin("/get_all_keys").split() if layout.model in k]) < written

    full = BLOCKS * 16
    on_a_only = 0
    for prompt in prompts:
        hit_a, hit_b = hit_tokens(a, layout, prompt), hit_tokens(b, layout, prompt)
        assert hit_a.hit_tokens == full, hit_a  # A finds every block: DRAM or its own disk
        assert hit_b.hit_tokens <= full
        if hit_b.hit_tokens < full:
            # What B misses is on A's disk alone: B does not claim it, and A serves it, byte-exact.
            on_a_only += 1
            warm_pass(on_a, prompt, hit_a)
        if hit_b.hit_tokens:
            warm_pass(on_b, prompt, hit_b)  # whatever B claims, it serves (from the shared DRAM pool)
    assert on_a_only >= 1, "every prompt stayed whole in DRAM: the test would prove nothing"
    on_a.close()
    on_b.close()
