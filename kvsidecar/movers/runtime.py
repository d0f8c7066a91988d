"""The daemon's CUDA side on a GPU node: the Mooncake build checked, contexts started in the background, the GPUs'
UUIDs, the segment page-locked, a staging area per device, and the path's health.

Measured on one H200 (docs/benchmarks/gpu.md): a process's first CUDA call costs about 0.6 s and importing CUDA torch
more, so a rank registering its KV cache with a daemon that had not started CUDA waited 5 s; page-locking an 8.5 GiB
segment takes 2.5 s. Both therefore start when the daemon starts, in a thread, and never on a node without a GPU.
Until the segment is page-locked the device path still works, its copies of the segment staged by the driver
(slower, same bytes); a CUDA registration that arrives while the contexts start waits for them.

Mooncake's non-CUDA build on a GPU node would read the device staging with memcpy and kill the daemon on the first
save: the path stays off then, saying why and how to install the CUDA build (store/build.py). A sticky CUDA error
(the context unusable) turns the path failed: `status`, the health service and `kvsidecar_gpu_failed` say so, and
every GPU request is refused with the reason (DeviceUnavailable) while host memory is served as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.errors import BadRequest, DeviceUnavailable
from kvsidecar.memory.slices import host_tensor
from kvsidecar.metrics import Metrics
from kvsidecar.movers.accelerators import Accelerator, Cpu, Cuda
from kvsidecar.movers.identity import ordinal_of
from kvsidecar.movers.staging import StagingArea
from kvsidecar.store import Store
from kvsidecar.store.base import Replica
from kvsidecar.store.build import CUDA_INSTALL, MooncakeBuild, installed_build
from kvsidecar.values import CudaHandle

__all__ = ["CUDA_START_TIMEOUT_S", "GpuRuntime", "GpuSettings", "HostSegment", "gpu_present"]

log = logging.getLogger(__name__)

MiB = 1 << 20
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context of the process
_PAGE = 4096
CUDA_START_TIMEOUT_S = 120.0  # a registration waits this long for the contexts started at the daemon's start
_NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")
MODES = ("auto", "off", "cpu")


def gpu_present(paths: Sequence[str] = _NVIDIA_NODES) -> bool:
    """Whether this node has an NVIDIA driver loaded: a check that imports nothing and starts nothing."""
    return any(os.path.exists(p) for p in paths)


@dataclass(frozen=True)
class GpuSettings:
    """What the GPU path is told (cut from Config): whether it runs, and each device's staging sizes.

    mode: auto (on a node with an NVIDIA driver), off (never), or cpu (a CPU stands in for a GPU: host memory moves
    through the device path; for tests of that path on machines without one)."""

    mode: str = "auto"
    staging_bytes: int = 256 * MiB
    bounce_bytes: int = 64 * MiB
    pin_segment: bool = True


@dataclass(frozen=True)
class HostSegment:
    """The store's segment as a host tensor the device path copies from, and whether it is page-locked."""

    replica: Replica
    tensor: Any
    pinned: bool


class GpuRuntime:
    """The Mooncake build check, CUDA contexts, the page-locked segment and one staging area per device, for the
    daemon's lifetime.

    devices: for tests, the accelerators to serve instead of every CUDA device (a CPU standing in for a GPU);
    present and build: what says this is a GPU node and which Mooncake build is installed (tests stand them in).
    """

    def __init__(
        self,
        settings: GpuSettings,
        store: Store,
        metrics: Metrics,
        *,
        devices: Sequence[Accelerator] | None = None,
        present: Callable[[], bool] = gpu_present,
        build: Callable[[], MooncakeBuild] = installed_build,
    ) -> None:
        self.settings = settings
        self._store = store
        self._metrics = metrics
        self._given = list(devices) if devices is not None else [Cpu("cpu")] if settings.mode == "cpu" else None
        self._present = present
        self._build = build
        self.devices: tuple[Accelerator, ...] = ()
        self.uuids: tuple[str, ...] = ()  # each CUDA device's UUID, in the daemon's order
        self.state = "off"
        self.reason = "not started"
        self.failure = ""  # why the path failed (a sticky CUDA error), "" while it has not
        self.segment: HostSegment | None = None
        self._areas: dict[str, StagingArea] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_in_s = 0.0
        self.pinned_in_s = 0.0

    @property
    def wanted(self) -> bool:
        """Whether this daemon runs the GPU path at all (a CPU node never does)."""
        if self._given is not None:
            return True
        return self.settings.mode != "off" and self._present()

    def start(self) -> None:
        """Start CUDA in the background (returns at once); a CPU node, --gpu off or the wrong Mooncake build start
        nothing, and say why."""
        if not self.wanted:
            self.reason = "--gpu off" if self.settings.mode == "off" else "no NVIDIA GPU on this node"
            self._ready.set()
            return
        if self._given is None:
            build = self._build()
            if not build.cuda:
                self.reason = (
                    f"Mooncake's non-CUDA build is installed here, {build.describe()}: it cannot read GPU memory; "
                    f"install the CUDA build ({CUDA_INSTALL})"
                )
                log.error("gpu: off on this GPU node: %s; CUDA regions will be refused", self.reason)
                self._ready.set()
                return
        self.state = "starting"
        self.reason = ""
        self._thread = threading.Thread(target=self._run, name="kvsidecar-gpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        began = time.monotonic()
        try:
            self.devices, self.uuids = self._start_devices()
            self.started_in_s = time.monotonic() - began
            log.info("gpu: %s ready in %.2f s", ", ".join(d.name for d in self.devices), self.started_in_s)
        except Exception as exc:  # a broken CUDA install must not take the daemon down: CPU ranks still work
            self.state = "off"
            self.reason = f"CUDA did not start: {exc}"
            log.error("gpu: %s; CUDA regions will be refused", self.reason)
            self._ready.set()
            return
        segment = self._store.segment()
        if segment is None:
            log.info("gpu: the store has no segment in this process: loads go through the store")
        else:
            with self._lock:
                self.segment = HostSegment(segment, host_tensor(segment.address, segment.size), False)
        self.state = "ready"
        self._ready.set()
        if segment is not None:
            self._pin(segment)

    def _start_devices(self) -> tuple[tuple[Accelerator, ...], tuple[str, ...]]:
        if self._given is not None:
            return tuple(self._given), ()
        import torch

        count = torch.cuda.device_count()
        if count < 1:
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        uuids = []
        for index in range(count):
            with torch.cuda.device(index):
                torch.empty(1, device=f"cuda:{index}")  # creates the device's primary context
            uuids.append(str(torch.cuda.get_device_properties(index).uuid))
        return tuple(Cuda(f"cuda:{i}") for i in range(count)), tuple(uuids)

    def _pin(self, segment: Replica) -> None:
        """Page-lock the segment, so that its copies are DMA transfers (until then the driver stages them)."""
        cuda = any(d.cuda for d in self.devices)
        if not (cuda and self.settings.pin_segment) or self._stopping.is_set():
            return
        began = time.monotonic()
        import torch

        # Whole pages (the segment's mapping is page-granular, so they are all its own).
        low = segment.address - segment.address % _PAGE
        high = -(-(segment.address + segment.size) // _PAGE) * _PAGE
        rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            low, high - low, _HOST_REGISTER_PORTABLE
        )
        if int(rc) != 0:
            log.warning("gpu: cudaHostRegister of the segment failed (%s): its copies stay staged", rc)
            return
        self.pinned_in_s = time.monotonic() - began
        self._metrics.gpu_pinned_bytes.set(segment.size)
        log.info("gpu: page-locked the %d MiB segment in %.2f s", segment.size // MiB, self.pinned_in_s)
        with self._lock:
            if self.segment is not None:
                self.segment = HostSegment(segment, self.segment.tensor, True)

    def wait_ready(self, timeout: float = CUDA_START_TIMEOUT_S) -> None:
        """Block until CUDA has started (or failed); raise BadRequest if CUDA regions cannot be served."""
        if not self._ready.wait(timeout):
            raise BadRequest("the daemon's CUDA contexts are still starting; register again in a moment")
        if self.state != "ready":
            raise BadRequest(f"this daemon moves no GPU memory ({self.reason}): register host memory instead")
        self.usable()

    def ordinal(self, handle: CudaHandle) -> int:
        """The daemon's index of the GPU a CUDA handle's memory is on (waiting for CUDA to start); BadRequest for a
        GPU it does not serve."""
        self.wait_ready()
        if not any(d.cuda for d in self.devices):
            served = ", ".join(d.name for d in self.devices)
            raise BadRequest(f"CUDA memory, but this daemon stands a CPU in for its GPU ({served})")
        return ordinal_of(handle.device_uuid, handle.device, self.uuids)

    def usable(self) -> None:
        """Raise DeviceUnavailable with the reason once the path has failed."""
        if self.failure:
            raise DeviceUnavailable(f"the daemon's GPU path failed ({self.failure}); restart the daemon")

    def fail(self, reason: str) -> None:
        """A sticky error: from now on every GPU request is refused with the reason, and health says so."""
        with self._lock:
            first = not self.failure
            self.failure = self.failure or reason
        if first:
            self._metrics.gpu_failed.set(1)
            log.error("gpu: the GPU path failed: %s; GPU requests are refused until the daemon restarts", reason)

    def area(self, device: str) -> StagingArea:
        """The device's staging area, allocated on first use."""
        self.wait_ready()
        with self._lock:
            area = self._areas.get(device)
            if area is None:
                accelerator = next((d for d in self.devices if d.name == device), None)
                if accelerator is None:
                    served = ", ".join(d.name for d in self.devices)
                    raise BadRequest(f"memory on {device}, which this daemon does not serve ({served})")
                area = StagingArea(
                    accelerator,
                    self.settings.staging_bytes,
                    self.settings.bounce_bytes,
                    self._store.register_buffer,
                    self._store.unregister_buffer,
                )
                self._areas[device] = area
                self._metrics.gpu_staging_bytes.set(sum(a.held_bytes for a in self._areas.values()))
            return area

    def host_segment(self) -> HostSegment | None:
        """The segment the device path copies from directly (None until known, or without one)."""
        with self._lock:
            return self.segment

    def describe(self) -> str:
        """One line for the ready line and `kvsidecar status`."""
        if self.failure:
            return f"FAILED ({self.failure}): GPU requests are refused"
        if self.state != "ready":
            return f"{self.state} ({self.reason})" if self.reason else self.state
        with self._lock:
            segment, areas = self.segment, dict(self._areas)
        names = ", ".join(d.name for d in self.devices)
        parts = [f"ready on {names} (CUDA started in {self.started_in_s:.2f} s)"]
        if segment is not None:
            lock = f"page-locked in {self.pinned_in_s:.2f} s" if segment.pinned else "not page-locked"
            parts.append(f"segment {segment.replica.size // MiB} MiB {lock}")
        else:
            parts.append("segment not page-locked yet")
        parts.append(
            f"staging {self.settings.staging_bytes // MiB} MiB + bounce {self.settings.bounce_bytes // MiB} MiB "
            f"per device, in use on {len(areas)}"
        )
        return "; ".join(parts)

    def stop(self) -> None:
        """Release the staging areas and unpin the segment (before the store frees it)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            areas, self._areas = list(self._areas.values()), {}
            segment, self.segment = self.segment, None
        for area in areas:
            area.close()
        if segment is not None and segment.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                segment.replica.address - segment.replica.address % _PAGE
            )
            self._metrics.gpu_pinned_bytes.set(0)
        self._metrics.gpu_staging_bytes.set(0)
        self.state = "off"
        self.reason = "stopped"
