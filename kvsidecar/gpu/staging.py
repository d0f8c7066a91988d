"""One device's staging area: where a batch of values is gathered to or lands, the pinned bounce for values the store
must fetch, the stream the area's copies run on, and the lock that gives one request the area at a time.

On a CPU (`device="cpu"`) the same area stands in for a GPU's: plain host tensors, no stream. That is how the device
path is tested on machines without a GPU; the daemon itself never runs it there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ALIGN", "StagingArea"]

ALIGN = 256  # bytes: every value's place in staging starts on a boundary the DMA engines and kernels like


class StagingArea:
    """Bounded device memory for one device's transfers, and a pinned host bounce beside it."""

    def __init__(
        self,
        device: str,
        staging_bytes: int,
        bounce_bytes: int,
        register: Callable[[int, int], None] = lambda address, size: None,
        unregister: Callable[[int], None] = lambda address: None,
    ) -> None:
        """register/unregister: the store's buffer registration (RDMA transports read and write only registered
        memory); both buffers are registered once, here, and unregistered by close()."""
        import torch

        self.device = device
        self.cuda = device.startswith("cuda")
        self._torch = torch
        self._unregister = unregister
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
        # Pinned, so a copy to or from it is one DMA (cudaMemcpy from pageable memory is staged by the driver).
        self.bounce = torch.empty(bounce_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        # Copies of the area run on a stream of the daemon's, never on the engine's.
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.lock = threading.Lock()
        self._registered: list[int] = []
        try:
            for tensor in (self.staging, self.bounce):
                register(int(tensor.data_ptr()), tensor.numel())
                self._registered.append(int(tensor.data_ptr()))
        except BaseException:
            self.close()
            raise

    @property
    def staging_bytes(self) -> int:
        """Size of the device staging buffer."""
        return int(self.staging.numel())

    @property
    def bounce_bytes(self) -> int:
        """Size of the pinned host bounce."""
        return int(self.bounce.numel())

    @contextmanager
    def held(self) -> Iterator[None]:
        """The area, for one batch of copies: locked, with its stream current on this thread."""
        with self.lock:
            if self.stream is None:
                yield
                return
            with self._torch.cuda.stream(self.stream):
                yield

    def synchronize(self) -> None:
        """Wait until every copy and kernel queued on the area's stream has finished."""
        if self.stream is not None:
            self.stream.synchronize()

    def index(self, ids: list[int]) -> Any:
        """Block ids as an index tensor on the device (one small host-to-device copy)."""
        return self._torch.tensor(ids, dtype=self._torch.int64, device=self.device)

    def close(self) -> None:
        """Unregister both buffers from the store; the memory goes back to torch's allocator with the tensors."""
        for address in self._registered:
            self._unregister(address)
        self._registered = []
