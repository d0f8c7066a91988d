"""The GPU runtime's life: never started on a node without a GPU, off with the reason on a GPU node whose Mooncake is
the non-CUDA build (told from its files, no GPU needed), CUDA memory refused with the reason whenever it is off, a
staging area per device on first use, and what status says at each stage (a CPU stands in for the GPU)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvsidecar.errors import BadRequest
from kvsidecar.metrics import Metrics
from kvsidecar.movers.accelerators import Cpu
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.runtime import GpuRuntime, GpuSettings, gpu_present
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.store.build import MooncakeBuild, installed_build, needed_libraries
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.tenancy.live import Grant
from kvsidecar.values import CudaHandle, RegionRequest, Role
from kvsidecar_contract.placement import GroupSpec, Kind, Layout

MiB = 1 << 20
CUDA_REGION = RegionRequest(CudaHandle(0, b"h" * 64, 1 << 20, 0, b"r", 0, b"e", False, "GPU-1"), 1 << 20, 0, 4096,
                            4096, 256, (0,))  # fmt: skip


def runtime(settings: GpuSettings | None = None, **kw: object) -> GpuRuntime:
    return GpuRuntime(settings or GpuSettings(), MemoryStore(), Metrics(CollectorRegistry()), **kw)  # type: ignore[arg-type]


def register_cuda(r: GpuRuntime) -> None:
    """A rank registering CUDA memory with a daemon over this runtime."""
    registry = SessionRegistry(10, Movers(MemoryStore(), gpu=r))
    session = registry.open(Role.RANK, Layout("m", (GroupSpec(Kind.MLA, 16),)), 32, "rank", grant=Grant(""))
    registry.attach(session, [CUDA_REGION])


def test_a_node_is_a_gpu_node_only_when_an_nvidia_driver_is_there(tmp_path):
    assert not gpu_present([str(tmp_path / "nvidiactl")])
    (tmp_path / "nvidiactl").touch()
    assert gpu_present([str(tmp_path / "absent"), str(tmp_path / "nvidiactl")])


def test_this_cpu_node_starts_nothing_and_refuses_cuda_memory_with_the_reason():
    r = runtime()
    assert not r.wanted  # no NVIDIA driver on the machines CI runs on
    r.start()
    assert r.describe() == "off (no NVIDIA GPU on this node)"
    with pytest.raises(BadRequest, match="no GPU path"):
        register_cuda(r)
    off = runtime(GpuSettings(mode="off"))
    off.start()
    assert off.describe() == "off (--gpu off)"


def test_the_mooncake_build_is_told_from_its_store_library(tmp_path, monkeypatch):
    # The build installed here (scripts/setup.sh's default): its store.so links no libcudart.
    here = installed_build()
    assert not here.cuda and "non-cuda" in here.distribution and "links no libcudart" in here.detail
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations
    library = Path(next(iter(spec.submodule_search_locations))) / "store.so"
    assert "libibverbs.so.1" in needed_libraries(library)  # what `readelf -d` lists as NEEDED
    # The same library, one of its NEEDED names changed to the CUDA runtime's (same length): a CUDA build.
    package = tmp_path / "cudamooncake"
    package.mkdir()
    (package / "__init__.py").touch()
    data = library.read_bytes()
    assert b"libnuma.so.1\0" in data
    (package / "store.so").write_bytes(data.replace(b"libnuma.so.1\0", b"libcudart.so\0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    cuda = installed_build("cudamooncake")
    assert cuda.cuda and cuda.detail == "store.so links libcudart.so"
    # No library at all: not a build that can read GPU memory.
    shutil.rmtree(package)
    (tmp_path / "nomooncake").mkdir()
    (tmp_path / "nomooncake" / "__init__.py").touch()
    assert not installed_build("nomooncake").cuda


def test_a_gpu_node_with_the_non_cuda_build_keeps_the_path_off_and_refuses_cuda_memory_saying_how_to_fix_it(caplog):
    # A stand-in node that says "GPU" while the wheel installed here is the non-CUDA one.
    r = runtime(present=lambda: True)
    assert r.wanted
    r.start()
    assert r.state == "off"
    assert "non-CUDA build is installed here" in r.describe() and "FLAVOUR=cuda scripts/setup.sh" in r.describe()
    assert next(rec.message for rec in caplog.records if "non-CUDA" in rec.message).startswith("gpu: off on this GPU")
    with pytest.raises(BadRequest, match="moves no GPU memory \\(Mooncake's non-CUDA build is installed here"):
        register_cuda(r)
    r.stop()


def test_a_gpu_node_whose_torch_sees_no_gpu_refuses_cuda_memory_with_the_reason():
    cuda = MooncakeBuild("mooncake-transfer-engine 0.3.13.post1", True, "store.so links libcudart.so.12")
    r = runtime(present=lambda: True, build=lambda: cuda)
    r.start()
    with pytest.raises(BadRequest, match=r"CUDA did not start: torch .* sees no CUDA device"):
        register_cuda(r)
    r.stop()


def test_a_standing_in_device_gets_its_staging_area_once_and_gives_it_back():
    metrics_registry = CollectorRegistry()
    r = GpuRuntime(GpuSettings("cpu", 16 * MiB, 16 * MiB), MemoryStore(), Metrics(metrics_registry))
    r.start()
    r.wait_ready(30)
    assert r.describe().startswith("ready on cpu")
    assert "staging 16 MiB + bounce 16 MiB per device, in use on 0" in r.describe()
    area = r.area("cpu")
    assert r.area("cpu") is area and area.staging_bytes == 4 * MiB and len(area.slots) == 4  # four slots
    assert metrics_registry.get_sample_value("kvsidecar_gpu_staging_bytes") == 16 * MiB
    with pytest.raises(BadRequest, match="memory on cuda:3, which this daemon does not serve \\(cpu\\)"):
        r.area("cuda:3")
    with pytest.raises(BadRequest, match="stands a CPU in for its GPU"):
        register_cuda(r)
    r.stop()
    assert r.describe() == "off (stopped)"
    assert metrics_registry.get_sample_value("kvsidecar_gpu_staging_bytes") == 0


def test_a_failed_path_says_so_everywhere_and_refuses_what_comes():
    metrics_registry = CollectorRegistry()
    r = GpuRuntime(GpuSettings("cpu"), MemoryStore(), Metrics(metrics_registry), devices=[Cpu("cpu")])
    r.start()
    r.wait_ready(30)
    assert metrics_registry.get_sample_value("kvsidecar_gpu_failed") == 0
    r.fail("cpu: an illegal memory access was encountered")
    r.fail("a later error")  # the first reason stands
    assert r.describe() == "FAILED (cpu: an illegal memory access was encountered): GPU requests are refused"
    assert metrics_registry.get_sample_value("kvsidecar_gpu_failed") == 1
    r.stop()
