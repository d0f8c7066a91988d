"""KVSidecarConnector with one switch for the negative control: noise over every block a load wrote.

Everything else is the stock connector. The switch is a file: while the path in KVSIDECAR_TEST_NOISE exists,
each finished load (every request of a step's LoadBatch) has the blocks it wrote overwritten with random values
before vLLM is told it finished, the way a daemon that delivered wrong bytes would leave them: every group's, or
only the recurrent (Mamba, gated delta net) groups' when the file says "recurrent". A test whose warm output
still equals the cold one with this on could not see wrong bytes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from kvsidecar_client.vllm import KVSidecarConnector
from kvsidecar_client.vllm.regions import regions_of
from kvsidecar_client.vllm.specs import engine_groups

NOISE_FLAG = "KVSIDECAR_TEST_NOISE"


class NoisyLoadsConnector(KVSidecarConnector):
    """The stock connector, plus noise over loaded blocks while the flag file exists."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._regions: list[tuple[torch.Tensor, list[int]]] = []
        groups = engine_groups(kv_cache_config)
        self._recurrent = {
            g
            for g, vllm_group in enumerate(groups.vllm_group_ids)
            if isinstance(kv_cache_config.kv_cache_groups[vllm_group].kv_cache_spec, MambaSpec)
        }
        worker = self._worker
        if worker is not None:
            run_loads = worker._run_loads

            def run_loads_then_noise(specs: Any, event: Any) -> dict[str, set[int]]:
                failed = run_loads(specs, event)
                flag = os.environ.get(NOISE_FLAG, "")
                if flag and os.path.exists(flag):
                    with open(flag) as f:
                        only_recurrent = f.read().strip() == "recurrent"
                    for spec in specs:
                        self._noise(spec.reads, failed[spec.req_id], only_recurrent)
                return failed

            worker._run_loads = run_loads_then_noise  # type: ignore[method-assign]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._worker
        assert worker is not None
        tensors, groups, _ = regions_of(kv_caches, worker._layers, worker._num_blocks)
        self._regions = [(t, list(g)) for t, g in zip(tensors, groups, strict=True)]

    def _noise(self, reads: tuple[tuple[int, ...], ...], failed: set[int], only_recurrent: bool) -> None:
        generator = torch.Generator().manual_seed(1234)
        for tensor, groups in self._regions:
            for g in groups:
                if only_recurrent and g not in self._recurrent:
                    continue
                for block in reads[g]:
                    if block in failed:
                        continue
                    target = tensor[block]
                    noise = torch.randn(target.shape, generator=generator, dtype=torch.float32)
                    target.copy_(noise.to(target.dtype) if target.is_floating_point() else noise.to(torch.int8))
