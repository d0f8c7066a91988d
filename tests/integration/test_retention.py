"""Retention against a real daemon process and a real mooncake_master: retained prompts outlive floods of ordinary
ones that evict everything else, within the tenant's budget and whole for a hybrid, until their time is up; an
operator's hard pin until it is dropped; hard pins and drops for operator credentials only; retention through a
daemon restart where the store outlives it; KV events that announce what the flood evicted and nothing retained.

A prompt is 4 blocks of a hybrid (full attention and Mamba state, 256 KiB a value): 2 MiB. The daemon's segment is
16 MiB and its master's read leases last 200 ms, so a flood of ordinary prompts evicts within a second.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from kvsidecar.cli.main import main
from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.events.messages import KVEventBatch
from kvsidecar_client import (
    DaemonProbe,
    EngineLayout,
    GroupSpec,
    PermissionDenied,
    Retention,
    SidecarClient,
    shared_tensor,
)
from kvsidecar_testing.hashes import chained_hashes
from kvsidecar_testing.processes import DaemonProcess, StorageNode, free_port
from kvsidecar_testing.waiting import wait_until
from support.kv_subscriber import KvSubscriber

pytestmark = pytest.mark.integration

U = 16
BLOCKS = 4  # blocks of a prompt
TOKENS = BLOCKS * U
VALUE = 256 << 10
MIB = 1 << 20
FAST = ("--master-lease-ttl-ms", "200", "--segment-size", "16MiB")
KEEP = Retention(300)


class Engine:
    """One rank of a hybrid engine through the client: blocks 0-3 are the prompt saved, 8-11 where a load goes."""

    def __init__(self, daemon: DaemonProcess, prefix: str = "", **kw: object) -> None:
        self.client = SidecarClient.connect(
            daemon.target, model="org/Hybrid", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
            groups=[GroupSpec("full_attention", U), GroupSpec("mamba", U)], cache_prefix=prefix, **kw,
        )  # fmt: skip
        self.kv = [shared_tensor((16, VALUE // 4), torch.float32) for _ in range(2)]
        self.client.register(self.kv, [(0,), (1,)])

    def save(self, name: str, retention: Retention | None = None, *, whole: bool = True):
        """Save prompt `name` from blocks 0-3, filled with its own bytes; `whole`: again until every value is
        stored (after a flood the daemon backs off a full store for up to 4 s: its saves fail with no_space)."""
        for g, t in enumerate(self.kv):
            t[:BLOCKS] = _content(name, g)
        ids = [list(range(BLOCKS))] * 2

        def saved():
            result = self.client.save(chained_hashes(name, BLOCKS), ids, TOKENS, retention=retention).result()
            return result if not (whole and result.failed) else None

        return wait_until(saved, timeout=30, what=f"prompt {name} stored whole")

    def hit(self, name: str) -> int:
        return self.client.lookup(chained_hashes(name, BLOCKS), TOKENS + 1).hit_tokens

    def loads_back(self, name: str) -> bool:
        """Load the hit into blocks 8-11; whether every block read is byte for byte what was saved."""
        hashes = chained_hashes(name, BLOCKS)
        hit = self.client.lookup(hashes, TOKENS + 1)
        n = hit.hit_tokens // U
        if n == 0 or self.client.load(hashes, [list(range(8, 8 + BLOCKS))] * 2, hit):
            return False
        return torch.equal(self.kv[0][8 : 8 + n], _content(name, 0)[:n]) and torch.equal(
            self.kv[1][8 + n - 1],
            _content(name, 1)[n - 1],  # the state at the hit's end
        )

    def close(self) -> None:
        self.client.close()


def _content(name: str, g: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{g}".encode()))
    return torch.rand((BLOCKS, VALUE // 4), generator=gen)


class Flood:
    """Ordinary prompts saved one after another, each new, to push everything else out of the segment."""

    def __init__(self, engine: Engine, tag: str) -> None:
        self.engine, self.tag, self.n = engine, tag, 0

    def until(self, done: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
        # A lookup leases what it finds, and Mooncake evicts the least recently leased first: between two checks
        # the flood writes more than the segment holds (20 MiB), so a value the last check found is evicted too.
        # A full store answers no_space while it evicts, and the flood goes on.
        def step() -> bool:
            for _ in range(10):
                self.n += 1
                self.engine.save(f"{self.tag}-{self.n}", whole=False)
            return done()

        wait_until(step, timeout=timeout, what=what)


def removed_in(batches: list) -> set[bytes]:
    """Every block hash the batches' BlockRemoved events name."""
    return {h for b in batches for e in b.events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}


def usage(daemon: DaemonProcess) -> dict[str, tuple[int, int, int, int]]:
    """Stats' retention: tenant -> (retained bytes, budget, hard-pinned bytes, values)."""
    with DaemonProbe(daemon.target) as probe:
        stats = probe.stats(30)
    return {u.tenant: (u.retained_bytes, u.budget_bytes, u.hard_pinned_bytes, u.values) for u in stats.retention}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("retention")
    events = ("--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}")
    replay = ("--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}")
    d = DaemonProcess(workdir, extra=(*FAST, "--retained-bytes", "3MiB", *events, *replay)).start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


@pytest.fixture
def engine(daemon) -> Iterator[Engine]:
    e = Engine(daemon)
    yield e
    # What a test retained does not carry over into the next one's budget (a single-tenant peer is an operator).
    with DaemonProbe(daemon.target) as probe:
        probe.drop_retention("", 30)
    e.client.reset()
    e.close()


def test_retained_prompts_outlive_a_flood_within_the_budget_whole_and_events_say_what_went(daemon, engine):
    topic = "kvsidecar"
    events = daemon.extra[daemon.extra.index("--kv-events-endpoint") + 1]
    replays = daemon.extra[daemon.extra.index("--kv-events-replay-endpoint") + 1]
    sub = KvSubscriber(events, replays, topic, msgspec.msgpack.Decoder(KVEventBatch).decode)
    try:
        a, b = engine.save("system-a", KEEP), engine.save("system-b", KEEP)
        ordinary = engine.save("one-off")
        # The budget (3 MiB) holds a and half of b: b's first two boundaries, attention and state alike.
        assert (a.written, a.retained, a.unretained) == (8, 8, 0)
        assert (b.written, b.retained, b.unretained) == (8, 4, 4)
        assert ordinary.retained == 0
        assert usage(daemon)[""] == (3 * MIB, 3 * MIB, 0, 12)
        soft = daemon.metric_samples("kvsidecar_tenant_retained_bytes", "pin")
        assert soft["soft"] == 3 * MIB
        flood = Flood(engine, "flood")
        flood.until(lambda: engine.hit("one-off") == 0 and engine.hit("system-b") == 32, "ordinary values evicted")
        assert engine.hit("system-a") == TOKENS and engine.loads_back("system-a")
        assert engine.loads_back("system-b")  # a hit at 32 tokens: b's state at 32 was kept with its attention
        # The eviction sweep announced the ordinary prompt's blocks removed, and none of the retained ones.
        batches = sub.collect(lambda bs: set(chained_hashes("one-off", BLOCKS)) <= removed_in(bs), timeout=60)
        removed = removed_in(batches)
        assert not removed & set(chained_hashes("system-a", BLOCKS))
        assert not removed & set(chained_hashes("system-b", 2))
    finally:
        sub.close()


def test_a_retained_prompt_is_ordinary_cache_again_after_its_time(daemon, engine):
    saved = engine.save("brief", Retention(2))
    started = time.monotonic()
    assert saved.retained == 8
    Flood(engine, "later").until(lambda: engine.hit("brief") == 0, "the prompt evicted once its time was up")
    assert time.monotonic() - started >= 2
    wait_until(lambda: usage(daemon)[""][3] == 0, timeout=30, what="the expired prompt no longer counted")


def test_an_operators_hard_pin_outlives_floods_until_it_is_dropped(daemon, engine, capsys):
    assert engine.save("pinned", Retention(hard=True)).retained == 8
    assert usage(daemon)[""] == (0, 3 * MIB, 2 * MIB, 8)
    engine.save("one-off")
    flood = Flood(engine, "flood-hard")
    flood.until(lambda: engine.hit("one-off") == 0, "the ordinary prompt evicted")
    assert engine.loads_back("pinned")
    # The operator's command: a daemon without a tenants file has one tenant, named by --drop alone.
    assert main(["retention", "--socket", daemon.socket, "--drop"]) == 0
    out = capsys.readouterr().out
    assert "dropped the retention of 8 values (2.0 MiB) of tenant (single tenant)" in out, out
    assert "(single tenant): 0.0 MiB of 3.0 MiB retained, 0 values, 0.0 MiB hard-pinned" in out, out
    flood.until(lambda: engine.hit("pinned") == 0, "the dropped pin's prompt evicted")


def test_hard_pins_and_drops_are_for_operator_credentials(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.eng]\nuids = [0]\nprefixes = ["eng"]\nretained_bytes = "1MiB"\n')
    d = DaemonProcess(tmp_path, extra=(*FAST, "--tenants", str(tenants), "--trust-local-accounts")).start()
    try:
        e = Engine(d, prefix="eng")
        try:
            with pytest.raises(PermissionDenied, match="no operator's credential"):
                e.save("x", Retention(hard=True))
            assert e.hit("x") == 0  # refused before anything was written
            assert (e.save("x", KEEP).retained, e.save("y", KEEP).retained) == (4, 0)  # its own budget: 1 MiB
            with DaemonProbe(d.target) as probe, pytest.raises(PermissionDenied, match="no operator's credential"):
                probe.drop_retention("eng", 30)
            assert usage(d) == {"eng": (MIB, MIB, 0, 4)}
        finally:
            e.close()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_retention_outlives_a_daemon_restart_where_the_store_does(tmp_path: Path, mooncake_client_env):
    # The values live on a storage node of an external master, which outlive the daemon; Mooncake keeps the pins.
    master = EmbeddedMaster(env=mooncake_client_env.variables(), lease_ttl_ms=200).start()
    node = StorageNode(master.address, tmp_path, segment="16MB").start()
    extra = ("--segment-size", "0", "--retained-bytes", "4MiB")
    d = DaemonProcess(tmp_path, master=master.address, extra=extra).start()
    try:
        e = Engine(d)
        assert e.save("system", KEEP).retained == 8
        e.save("one-off")
        e.close()
        assert d.stop() == 0
        d.start()
        e = Engine(d)
        try:
            Flood(e, "after").until(lambda: e.hit("one-off") == 0, "the ordinary prompt evicted after the restart")
            assert e.loads_back("system")
        finally:
            e.close()
    finally:
        d.stop()
        node.stop()
        master.stop()
