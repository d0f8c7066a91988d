"""KVSidecarConnector: vLLM's KV-connector interface over a kvsidecar session.

Enable it with one flag:

    --kv-transfer-config '{"kv_connector": "KVSidecarConnector", "kv_connector_module_path": "kvsidecar_client.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "unix:///run/kvsidecar/kvsidecar.sock"}}'

vLLM builds one instance in its scheduler (role SCHEDULER: lookups, planning) and one in every worker (role WORKER:
register memory, loads, saves). This class only routes vLLM's calls to the side that serves them.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvsidecar_client.allocation import SharedMemoryAllocation
from kvsidecar_client.client import SidecarClient
from kvsidecar_client.vllm.identity import value_identity
from kvsidecar_client.vllm.metadata import KVSidecarMetadata
from kvsidecar_client.vllm.plan import shape_of
from kvsidecar_client.vllm.scheduler import SchedulerSide
from kvsidecar_client.vllm.settings import DEFAULT_WAIT_SLACK, ConnectorSettings
from kvsidecar_client.vllm.specs import (
    StateOf,
    engine_groups,
    hash_block_size,
    hash_bytes,
    hit_alignment,
    layout_of_this_rank,
    parallel_layout,
)
from kvsidecar_client.vllm.states import describe_state
from kvsidecar_client.vllm.stats import KVSidecarPromMetrics, KVSidecarStats
from kvsidecar_client.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["KVSidecarConnector"]

log = logging.getLogger("kvsidecar_client.vllm")


class KVSidecarConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector backed by the node's kvsidecar daemon (hybrid models included)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        model_config = vllm_config.model_config
        # Rule 12: where values are shared across TP sizes, each recurrent group's state is described (and checked
        # against vLLM's own MambaSpec) so the daemon can store it in pieces every TP size reads.
        state_of: StateOf | None = None
        if settings.share_across_tp is not False:
            text_config = model_config.hf_text_config
            state_of = partial(describe_state, hf_config=text_config, tp_size=int(parallel.tensor_parallel_size))
        groups = engine_groups(kv_cache_config, state_of)
        unit = hash_block_size(kv_cache_config, vllm_config)
        alignment, fine_grained = hit_alignment(kv_cache_config, vllm_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        identity = value_identity(vllm_config, kv_cache_config, pinned=settings.model_identity or None)
        log.info("kvsidecar value identity %s (docs/values.md)", identity)
        client = SidecarClient.connect(
            settings.socket,
            model=model_config.model,
            layout=parallel_layout(parallel) if scheduler else layout_of_this_rank(parallel),
            num_kv_heads=max(1, int(model_config.get_total_num_kv_heads())),
            hash_block_size=unit,
            groups=groups.specs,
            cache_prefix=settings.cache_prefix,
            value_identity=identity,
            role="scheduler" if scheduler else "rank",
            hash_bytes=hash_bytes(vllm_config.cache_config.prefix_caching_hash_algo),
            deadlines=settings.deadlines,
            hit_alignment_tokens=alignment,
            fine_grained_hits=fine_grained,
            share_across_tp=settings.share_across_tp,
        )
        if transfer.is_kv_consumer and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a block the store lost after a lookup fails its request instead of "
                'being recomputed; add "kv_load_failure_policy": "recompute" to --kv-transfer-config',
                transfer.kv_load_failure_policy,
            )
        self._client = client
        self._cpu = getattr(vllm_config.device_config, "device_type", "") == "cpu"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        info = client.session_info
        assert info is not None  # connect() returns with a session open
        if scheduler:
            spec = vllm_config.speculative_config
            self._scheduler = SchedulerSide(
                client,
                groups,
                shape_of(client.spec, info),
                eagle=spec is not None and spec.use_eagle_block_drop(),
                load=transfer.is_kv_consumer,
                save=transfer.is_kv_producer,
                lookup_deadline=settings.deadlines.lookup,
                retention=settings.retention,
            )
        else:
            self._worker = WorkerSide(
                client,
                [kv_cache_config.kv_cache_groups[g].layer_names for g in groups.vllm_group_ids],
                kv_cache_config.num_blocks,
                block_ids_unique=len(kv_cache_config.kv_cache_groups) == 1,
                wait_timeout=settings.deadlines.save + DEFAULT_WAIT_SLACK,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save lost to a preemption is a future miss, not a failed hand-off."""
        return False

    @property
    def client(self) -> SidecarClient:
        """The session with the daemon (for operators and tests: stats, session info)."""
        return self._client

    @property
    def lookups_in_flight(self) -> int:
        """Scheduler only: requests whose lookup was sent and whose answer vLLM has not taken up yet."""
        return self._scheduler_side().lookups_in_flight

    def wait_for_lookups(self, timeout: float) -> bool:
        """Scheduler only: wait up to `timeout` s for every lookup in flight to be answered (True: none left)."""
        return self._scheduler_side().wait_for_lookups(timeout)

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("this KVSidecarConnector is a worker; the call belongs to the scheduler's")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("this KVSidecarConnector is the scheduler's; the call belongs to a worker's")
        return self._worker

    def _meta(self) -> KVSidecarMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVSidecarMetadata) else None

    # ---- worker side ----

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """On CPU, vLLM's KV-cache allocation in shared memory the daemon maps (GPU caches use CUDA IPC)."""
        self._worker_side()
        return SharedMemoryAllocation() if self._cpu else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVSidecarMetadata):
            worker = self._worker_side()
            worker.ingest(kv_connector_metadata)
            worker.fence(kv_connector_metadata.reused_block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker_side().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM schedules a loading request only after the load is reported finished.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # A block's value spans every layer of its group: the daemon reads them all in one save per step.
        return

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker_side().start_saves(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._worker_side().transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVSidecarStats | None:
        """This side's counts since vLLM last asked (lookups on the scheduler's, loads and saves on a worker's)."""
        side = self._worker if self._worker is not None else self._scheduler
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVSidecarStats:
        return KVSidecarStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVSidecarPromMetrics:
        return KVSidecarPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_block_ids()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        else:
            self._client.close()

    # ---- scheduler side ----

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request)
