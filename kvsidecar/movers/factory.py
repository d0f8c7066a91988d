"""Which mover a session memory gets, decided once, when the memory is registered: host memory moves with the
store's own zero-copy calls, GPU memory through its device's staging; on a daemon standing a CPU in for a GPU
(--gpu cpu, tests of the device path), host memory takes the device path too."""

from __future__ import annotations

from kvsidecar.errors import BadRequest
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import Mover
from kvsidecar.movers.device import DeviceMover
from kvsidecar.movers.host import HostMover
from kvsidecar.movers.runtime import GpuRuntime
from kvsidecar.movers.sums import Sums
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.store import Store
from kvsidecar.values import CudaHandle

__all__ = ["Movers"]


class Movers:
    """Makes each session memory's mover, over the daemon's store and (if it has one) its GPU path."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics | None = None,
        gpu: GpuRuntime | None = None,
        checksums: ChecksumSettings | None = None,
    ) -> None:
        """gpu: the GPU path, which takes GPU memory (without it, or while it is off, GPU memory is refused);
        checksums: which values carry a checksum trailer (--checksums; by default, the daemon's default)."""
        self._store = store
        self._metrics = metrics or Metrics()
        self._sums = Sums(checksums or ChecksumSettings(), store, self._metrics)
        # Which values carry a checksum trailer: every session's layout says so in its value id.
        self.checksum_every = self._sums.checksum_every
        self._gpu = gpu if gpu is not None and gpu.wanted else None
        # A CPU standing in for the GPU (--gpu cpu): host memory moves through the device path.
        self._stand_in = self._gpu is not None and self._gpu.settings.mode == "cpu"

    def cuda_ordinal(self, handle: CudaHandle) -> int:
        """The daemon's index of the GPU a CUDA region is on, or BadRequest why this daemon cannot take it."""
        if self._gpu is None:
            raise BadRequest("CUDA memory, but this daemon has no GPU path (no NVIDIA GPU, or --gpu off)")
        return self._gpu.ordinal(handle)

    def close(self) -> None:
        """Let go of what the movers share (the trailer memory registered with the store): every session is closed."""
        self._sums.close()

    def mover(self, memory: SessionMemory) -> Mover:
        """The memory's mover; BadRequest when its values cannot move (a device not served, a value too large)."""
        device = memory.device or ("cpu" if self._stand_in else None)
        if device is None:
            return HostMover(self._store, memory, self._metrics, self._sums)
        if self._gpu is None:
            raise BadRequest("this daemon moves no device memory")
        return DeviceMover(self._gpu, device, self._store, memory, self._metrics, self._sums)
