"""KV events of a daemon in this process (in-memory store) over a real socket: what a save stored, what a reset
cleared, on the saving tenant's topic. vLLM's own decoder reads the same messages in tests/vllm_connector."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import torch

from kvsidecar.daemon.process import DaemonError
from kvsidecar.events.messages import MEDIUM_CPU, KVEventBatch
from kvsidecar.store import StoreCode
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient, shared_tensor
from support.inprocess import InProcessDaemon
from support.kv_subscriber import KvSubscriber, stored_hashes

U = 16
DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def prompt(seed: str, n: int) -> list[bytes]:
    """n chained 32-byte block hashes."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{seed}/{i}".encode()).digest()
        out.append(prev)
    return out


def start(tmp_path: Path, store: MemoryStore | None = None, **settings: object) -> InProcessDaemon:
    return InProcessDaemon(
        tmp_path,
        store if store is not None else MemoryStore(),
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
        **settings,
    ).start()


def connect(daemon: InProcessDaemon, prefix: str = "") -> SidecarClient:
    client = SidecarClient.connect(
        daemon.target, model="org/Model", layout=EngineLayout(), num_kv_heads=1, hash_block_size=U,
        groups=[GroupSpec("full_attention", U)], cache_prefix=prefix,
    )  # fmt: skip
    client.register([shared_tensor((8, 64), torch.float32)], [(0,)])
    return client


def subscriber(daemon: InProcessDaemon, topic: str) -> KvSubscriber:
    assert daemon.daemon is not None and daemon.daemon.kv_events is not None
    publisher = daemon.daemon.kv_events.publisher
    return KvSubscriber(publisher.address, publisher.replay_address, topic, DECODE)


@pytest.fixture
def daemon(tmp_path):
    d = start(tmp_path)
    yield d
    d.stop()


def test_a_save_announces_exactly_the_blocks_it_wrote_with_their_tokens_and_a_reset_clears(daemon):
    sub = subscriber(daemon, "kvsidecar")
    client = connect(daemon)
    try:
        hashes = prompt("a", 4)
        tokens = list(range(1000, 1000 + 4 * U + 5))  # a partial block's tokens beyond the last hash: no event
        result = client.save(hashes, [[0, 1, 2, 3]], 4 * U + 5, token_ids=tokens).result()
        assert result.written == 4
        (batch,) = sub.collect(lambda bs: len(bs) >= 1)
        (event,) = batch.events
        assert event.block_hashes == hashes
        assert event.parent_block_hash is None
        assert event.token_ids == tokens[: 4 * U]
        assert (event.block_size, event.group_idx, event.medium) == (U, 0, MEDIUM_CPU)
        assert event.kv_cache_spec_kind == "full_attention"
        # A later save of the same prompt, two blocks longer: only the new blocks, chained to the last stored one,
        # with the tokens sent from where the save starts.
        longer = prompt("a", 6)
        more = list(range(2000, 2000 + 2 * U))
        again = client.save(longer, [[0, 1, 2, 3, 4, 5]], 6 * U, saved_tokens=4 * U, token_ids=more,
                            token_ids_start=4 * U).result()  # fmt: skip
        assert again.written == 2
        (batch,) = sub.collect(lambda bs: len(bs) >= 1)
        (event,) = batch.events
        assert event.block_hashes == longer[4:]
        assert event.parent_block_hash == longer[3]
        assert event.token_ids == more
        # Values already stored are not announced again; a reset clears the topic.
        assert client.save(hashes, [[0, 1, 2, 3]], 4 * U).result().skipped == 4
        client.reset()
        (batch,) = sub.collect(lambda bs: len(bs) >= 1)
        assert [type(e).__name__ for e in batch.events] == ["AllBlocksCleared"]
    finally:
        client.close()
        sub.close()


def test_a_value_whose_write_failed_is_not_announced(tmp_path):
    store = MemoryStore()
    daemon = start(tmp_path, store)
    sub = subscriber(daemon, "kvsidecar")
    client = connect(daemon)
    try:
        hashes = prompt("f", 4)
        lost = hashes[1].hex()
        store.set_fault(lambda op, key: StoreCode.NO_SPACE if op == "put" and key.endswith(lost) else None)
        result = client.save(hashes, [[0, 1, 2, 3]], 4 * U, token_ids=list(range(4 * U))).result()
        assert (result.written, result.failed) == (3, 1)
        events = [e for b in sub.collect(lambda bs: len(stored_hashes(bs)) >= 3) for e in b.events]
        assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
            ([hashes[0]], None),
            ([hashes[2], hashes[3]], hashes[1]),  # chained to the block before it, stored or not
        ]
        assert events[1].token_ids == list(range(2 * U, 4 * U))
    finally:
        client.close()
        sub.close()
        daemon.stop()


def test_tokens_past_the_saved_tokens_are_refused(daemon):
    client = connect(daemon)
    try:
        job = client.save(prompt("b", 2), [[0, 1]], 2 * U, token_ids=list(range(2 * U + 1)))
        with pytest.raises(Exception, match="run past num_tokens"):
            job.result()
    finally:
        client.close()


def test_a_tenant_publishes_on_its_own_topic(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.team-a]\nuids = [0]\nprefixes = ["team-a*"]\n')
    daemon = start(tmp_path, tenants=str(tenants))
    mine = subscriber(daemon, "kvsidecar.team-a")
    client = connect(daemon, "team-a")
    try:
        hashes = prompt("t", 2)
        assert client.save(hashes, [[0, 1]], 2 * U).result().written == 2
        assert stored_hashes(mine.collect(lambda bs: len(bs) >= 1)) == hashes
        assert mine.replay(0, "kvsidecar") == []  # nothing on the base topic
    finally:
        client.close()
        mine.close()
        daemon.stop()


def test_an_event_endpoint_in_use_stops_the_start_with_the_reason(daemon, tmp_path):
    assert daemon.daemon is not None and daemon.daemon.kv_events is not None
    taken = daemon.daemon.kv_events.publisher.address
    (tmp_path / "second").mkdir()
    second = InProcessDaemon(tmp_path / "second", MemoryStore(), kv_events_endpoint=taken)
    with pytest.raises(DaemonError, match=r"--kv-events-endpoint tcp://.*: cannot bind it: Address already in use"):
        second.start()
    second.stop()
