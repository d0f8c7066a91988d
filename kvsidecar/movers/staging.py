"""One device's staging, shared by the requests in flight: SLOTS slots, each a share of the device staging buffer
and of the page-locked bounce, index buffers and a stream of its own.

A request takes a slot for all its rounds and gives it back only once everything it queued on the slot's stream has
completed (movers/device.py states the whole ordering), so requests on different slots overlap (a load beside a
save) and a slot is never handed over with work in flight. On a CPU standing in for a GPU the same area is host
memory and the streams are None (movers/accelerators.py).
"""

from __future__ import annotations

import array
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvsidecar.movers.accelerators import Accelerator

__all__ = ["ALIGN", "SLOTS", "Slot", "StagingArea"]

ALIGN = 256  # bytes: every value's place in staging starts on a boundary the DMA engines and kernels like
SLOTS = 4  # requests of one device that move bytes at once; more wait for a slot (they would share the link anyway)
_INT64 = 8


class Slot:
    """One request's share of a device's staging: staging (on the device), bounce (host, page-locked on a GPU),
    block-id index buffers (a page-locked host one and its device copy) and the stream everything runs on."""

    def __init__(self, device: Accelerator, staging: Any, bounce: Any, index_host: Any, index_device: Any) -> None:
        self.device = device
        self.staging = staging
        self.bounce = bounce
        self.stream = device.stream()
        self._index_host = index_host
        self._index_device = index_device
        self._index_address = int(index_host.data_ptr())
        self._typed: dict[Any, Any] = {}
        self._used = 0  # index entries handed out since the stream last idled

    @property
    def staging_bytes(self) -> int:
        """Bytes of device staging this slot holds."""
        return int(self.staging.numel())

    @property
    def bounce_bytes(self) -> int:
        """Bytes of host bounce this slot holds."""
        return int(self.bounce.numel())

    @property
    def index_capacity(self) -> int:
        """Block ids one round may upload (one per ALIGN bytes of staging)."""
        return int(self._index_host.numel())

    def typed(self, dtype: Any) -> Any:
        """The whole staging as elements of dtype (a slot's staging starts on an ALIGN boundary)."""
        view = self._typed.get(dtype)
        if view is None:
            whole = self.staging[: self.staging_bytes - self.staging_bytes % dtype.itemsize]
            view = self._typed[dtype] = whole.view(dtype)
        return view

    def index(self, ids: Sequence[int]) -> Any:
        """Block ids as an int64 tensor on the device, uploaded without the host waiting for the upload.

        Each call takes the next entries of the page-locked buffer, so an upload still queued is never overwritten;
        when they run out, the host waits for the stream once (everything uploaded before has been read)."""
        n = len(ids)
        capacity = self.index_capacity
        if n > capacity:
            raise ValueError(f"{n} block ids at once, more than a slot's {capacity}")
        if self._used + n > capacity:
            self.synchronize()
        at = self._used
        self._used = at + n
        packed = array.array("q", ids)
        ctypes.memmove(self._index_address + at * _INT64, packed.buffer_info()[0], n * _INT64)
        out = self._index_device[at : at + n]
        out.copy_(self._index_host[at : at + n], non_blocking=True)
        return out

    def synchronize(self) -> None:
        """Wait until everything queued on the slot's stream has completed."""
        self.device.synchronize(self.stream)
        self._used = 0


class StagingArea:
    """Bounded device memory for one device's transfers and a page-locked host bounce beside it, cut into slots."""

    def __init__(
        self,
        device: Accelerator,
        staging_bytes: int,
        bounce_bytes: int,
        register: Callable[[int, int], None] = lambda address, size: None,
        unregister: Callable[[int], None] = lambda address: None,
        *,
        slots: int = SLOTS,
    ) -> None:
        """register/unregister: the store's buffer registration (RDMA transports read and write only registered
        memory); both buffers are registered once, here, and unregistered by close()."""
        import torch

        self.device = device
        self._unregister = unregister
        per_staging = staging_bytes // slots // ALIGN * ALIGN
        per_bounce = bounce_bytes // slots // ALIGN * ALIGN
        if per_staging < ALIGN or per_bounce < ALIGN:
            raise ValueError(f"staging {staging_bytes} and bounce {bounce_bytes} bytes cannot make {slots} slots")
        self._staging = device.empty(per_staging * slots, torch.uint8)
        self._bounce = device.empty(per_bounce * slots, torch.uint8, host=True)
        # One block id per ALIGN bytes of staging: more than the values a slot can hold at once.
        entries = per_staging // ALIGN
        index_host = device.empty(entries * slots, torch.int64, host=True)
        index_device = device.empty(entries * slots, torch.int64)
        self.slots = [
            Slot(
                device,
                self._staging[i * per_staging : (i + 1) * per_staging],
                self._bounce[i * per_bounce : (i + 1) * per_bounce],
                index_host[i * entries : (i + 1) * entries],
                index_device[i * entries : (i + 1) * entries],
            )
            for i in range(slots)
        ]
        self._free = list(self.slots)
        self._changed = threading.Condition()
        self._registered: list[int] = []
        try:
            for tensor in (self._staging, self._bounce):
                register(int(tensor.data_ptr()), tensor.numel())
                self._registered.append(int(tensor.data_ptr()))
        except BaseException:
            self.close()
            raise

    @property
    def staging_bytes(self) -> int:
        """Device staging of one slot: the most one round of one request moves."""
        return self.slots[0].staging_bytes

    @property
    def bounce_bytes(self) -> int:
        """Host bounce of one slot."""
        return self.slots[0].bounce_bytes

    @property
    def free(self) -> int:
        """Slots no request holds now."""
        with self._changed:
            return len(self._free)

    @property
    def held_bytes(self) -> int:
        """Device memory the area holds, every slot's."""
        return int(self._staging.numel())

    @contextmanager
    def slot(self) -> Iterator[Slot]:
        """A free slot (waiting for one), its stream current on this thread; given back, whatever happened, once
        the work queued on it has completed."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._free))
            slot = self._free.pop()
        try:
            with self.device.on(slot.stream):
                yield slot
        finally:
            try:
                slot.synchronize()
            finally:
                with self._changed:
                    self._free.append(slot)
                    self._changed.notify()

    def close(self) -> None:
        """Unregister both buffers from the store; the memory goes back to torch's allocator with the tensors."""
        for address in self._registered:
            self._unregister(address)
        self._registered = []
