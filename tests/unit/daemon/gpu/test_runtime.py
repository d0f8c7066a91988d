"""The GPU runtime's life: never started on a node without a GPU, CUDA memory refused with the reason when it is
off, a staging area per device on first use, and what status says at each stage (a CPU stands in for the GPU)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.errors import BadRequest
from kvsidecar.gpu.runtime import GpuRuntime, GpuSettings, gpu_present
from kvsidecar.metrics import Metrics
from kvsidecar.store.memory_store import MemoryStore

MiB = 1 << 20


def runtime(settings: GpuSettings | None = None) -> GpuRuntime:
    return GpuRuntime(settings or GpuSettings(), MemoryStore(), Metrics(CollectorRegistry()))


def test_a_node_is_a_gpu_node_only_when_an_nvidia_driver_is_there(tmp_path):
    assert not gpu_present([str(tmp_path / "nvidiactl")])
    (tmp_path / "nvidiactl").touch()
    assert gpu_present([str(tmp_path / "absent"), str(tmp_path / "nvidiactl")])


def test_this_cpu_node_starts_nothing_and_refuses_cuda_memory_with_the_reason():
    r = runtime()
    assert not r.wanted  # no NVIDIA driver on the machines CI runs on
    r.start()
    assert r.describe() == "off (no NVIDIA GPU on this node)"
    with pytest.raises(BadRequest, match="moves no GPU memory \\(no NVIDIA GPU on this node\\)"):
        r.wait_ready(1)
    off = runtime(GpuSettings(mode="off"))
    off.start()
    assert off.describe() == "off (--gpu off)"


def test_a_standing_in_device_gets_its_staging_area_once_and_gives_it_back():
    metrics_registry = CollectorRegistry()
    r = GpuRuntime(GpuSettings(staging_bytes=16 * MiB, bounce_bytes=16 * MiB), MemoryStore(), Metrics(metrics_registry),
                   devices=["cpu"])  # fmt: skip
    r.start()
    r.wait_ready(30)
    assert r.describe().startswith("ready on cpu")
    assert "staging 16 MiB + bounce 16 MiB per device, in use on 0" in r.describe()
    area = r.area("cpu")
    assert r.area("cpu") is area and area.staging_bytes == 16 * MiB
    assert metrics_registry.get_sample_value("kvsidecar_gpu_staging_bytes") == 16 * MiB
    with pytest.raises(BadRequest, match="memory on cuda:3, which this daemon does not serve \\(cpu\\)"):
        r.area("cuda:3")
    r.stop()
    assert r.describe() == "off (stopped)"
    assert metrics_registry.get_sample_value("kvsidecar_gpu_staging_bytes") == 0
