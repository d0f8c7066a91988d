"""vLLM's own KV-event classes read the daemon's events: blocks the connector saved (with their tokens), values the
store lost (the eviction sweep), a reset, and the listeners in `kvsidecar status`. A real daemon and Mooncake."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from msgspec.msgpack import Decoder
from sidecar_daemon import SidecarDaemon
from sidecar_engine import BLOCK, LAYOUTS, Engine, kv_cache_config, vllm_config
from test_failures import key
from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvsidecar_testing.processes import free_port
from support.kv_subscriber import KvSubscriber, stored_hashes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = [(i * 37 + 11) % 1000 for i in range(3 * BLOCK + 5)]  # three whole blocks and a partial one
TOPIC = "kvsidecar"
DECODE = Decoder(KVEventBatch).decode


@pytest.fixture(scope="module")
def events_daemon(tmp_path_factory):
    """A daemon publishing KV events on loopback, with replay; the sweep looks every second."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    extra = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, "--kv-events-topic", TOPIC]
    proc = SidecarDaemon(tmp_path_factory.mktemp("kvsidecar-events"), extra=extra).start()
    proc.endpoints = (pub, replay)
    try:
        yield proc
    finally:
        proc.stop()


def test_vllms_decoder_reads_the_saved_blocks_the_evicted_ones_and_the_reset(
    vllm_env, tiny_model, events_daemon, cache_prefix
):
    sub = KvSubscriber(*events_daemon.endpoints, TOPIC, DECODE)
    config = vllm_config(tiny_model, {"socket": events_daemon.target, "cache_prefix": cache_prefix})
    engine = Engine.start(config, kv_cache_config(LAYOUTS["full"]))
    try:
        engine.add("r", PROMPT)
        hashes = list(engine.request("r").block_hashes)[:3]
        engine.run_until("r")
        batches = sub.collect(lambda bs: len(stored_hashes(bs)) >= 3)
        # Exactly the engine's hashes of the three whole blocks, in vLLM's own classes, with their tokens.
        assert stored_hashes(batches) == hashes
        stored = [e for b in batches for e in b.events]
        assert all(isinstance(e, BlockStored) for e in stored)
        assert [t for e in stored for t in e.token_ids] == PROMPT[: 3 * BLOCK]
        assert {(e.block_size, e.group_idx, e.medium, e.kv_cache_spec_kind) for e in stored} == {
            (BLOCK, 0, MEDIUM_CPU, "full_attention")
        }
        assert stored[0].parent_block_hash is None

        # The store loses block 1 behind the daemon's back (as an eviction would): the sweep announces it.
        events_daemon.remove_keys([key(engine, 0, hashes[1])])
        (removed,) = [e for b in sub.collect(lambda bs: len(bs) >= 1) for e in b.events]
        assert isinstance(removed, BlockRemoved)
        assert (removed.block_hashes, removed.medium, removed.group_idx) == ([hashes[1]], MEDIUM_CPU, 0)

        engine.worker.client.reset()
        (cleared,) = [e for b in sub.collect(lambda bs: len(bs) >= 1) for e in b.events]
        assert isinstance(cleared, AllBlocksCleared)
    finally:
        engine.close()
        sub.close()


def test_status_lists_the_event_sockets(events_daemon):
    info = json.loads(events_daemon.status().stdout)
    roles = {item["role"]: item["address"] for item in info["listeners"]}
    pub, replay = events_daemon.endpoints
    assert roles["kv-events"] == pub
    assert roles["kv-events-replay"] == replay
    assert info["counters"]["kvsidecar_kv_events_events_total"] >= 0
