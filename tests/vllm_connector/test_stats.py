"""The connector's stats through vLLM's own stats machinery: the scheduler's lookups, a worker's saves and loads,
aggregated as vLLM aggregates them, logged by vLLM's KVConnectorLogging and exported by its KVConnectorProm."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from prometheus_client import REGISTRY
from sidecar_engine import BLOCK, LAYOUTS, Engine, kv_cache_config, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

from kvsidecar_client.vllm.stats import KVSidecarStats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = [(i * 29 + 3) % 1000 for i in range(4 * BLOCK + 3)]


def engine(model, daemon, prefix):
    return Engine.start(
        vllm_config(model, {"socket": daemon.target, "cache_prefix": prefix}), kv_cache_config(LAYOUTS["full"])
    )


def test_vllm_logs_and_exports_the_connectors_lookups_saves_and_loads(vllm_env, tiny_model, daemon, cache_prefix):
    cold = engine(tiny_model, daemon, cache_prefix)
    try:
        cold.add("cold", PROMPT)
        cold.run_until("cold")
    finally:
        cold.close()  # waits for the saves in flight: their answers are counted
    saved = cold.worker.get_kv_connector_stats()
    assert isinstance(saved, KVSidecarStats)
    assert saved.data["saved_blocks"] == 4 and saved.data["saved_bytes"] > 0
    assert saved.data["saves"] >= 1 and saved.data["save_failures"] == 0

    warm = engine(tiny_model, daemon, cache_prefix)
    try:
        warm.add("warm", PROMPT)
        # The scheduler's own calls, before vLLM steps (a step would hand the counts to vLLM's scheduler stats): the
        # first starts the lookup and answers "not yet" (None), the one after its answer takes it up.
        request = warm.request("warm")
        matched, _ = warm.connector.get_num_new_matched_tokens(request, 0)
        if matched is None:
            assert warm.connector.wait_for_lookups(60), "no answer to the lookup"
            matched, _ = warm.connector.get_num_new_matched_tokens(request, 0)
        assert matched == 4 * BLOCK
        looked = warm.connector.get_kv_connector_stats()
        assert warm.connector.get_kv_connector_stats() is None  # taken once
        warm.run_until("warm")
    finally:
        warm.close()
    loaded = warm.worker.get_kv_connector_stats()
    assert looked is not None and looked.data["lookups"] == 1
    assert (looked.data["lookup_tokens"], looked.data["hit_tokens"]) == (len(PROMPT), 4 * BLOCK)
    assert loaded is not None and loaded.data["loaded_blocks"] == 4 and loaded.data["load_failed_blocks"] == 0

    # As vLLM carries them: worker stats in the step's output, the scheduler's aggregated in, a dict to the loggers.
    total = KVSidecarStats(data=dict(saved.data)).aggregate(loaded).aggregate(looked)
    data = total.to_dict()
    config = warm.config
    logging = KVConnectorLogging(config.kv_transfer_config)
    logging.observe(data)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "saved_blocks=4" in line and "loaded_blocks=4" in line and "hit_rate=" in line

    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kvsidecar_saved_blocks_total", labels) == 4
    assert REGISTRY.get_sample_value("vllm:kvsidecar_hit_tokens_total", labels) == 4 * BLOCK
