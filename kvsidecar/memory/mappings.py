"""The kinds of engine memory the daemon maps, and which of them a session may hand it.

- `MemfdMapping` (memfd.py): a sealed memfd passed over the side socket, the default for CPU memory;
- `ShmMapping`: a named /dev/shm segment, for trusted ranks only (it can be truncated under a transfer);
- `CudaIpcMapping`: a CUDA allocation opened through torch's IPC handles.

`Opener` turns a region's handle into its mapping, refusing what the session's rights do not include: a session may
use /dev/shm names only when granted explicitly (`shm_names=True`), never by default.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvsidecar.errors import BadRequest, Forbidden
from kvsidecar.memory.backing import backed_bytes, require_backed, require_shmem
from kvsidecar.memory.memfd import MemfdMapping
from kvsidecar.memory.populate import Populator
from kvsidecar.memory.slices import host_tensor
from kvsidecar.values import CudaHandle, Handle, MemfdHandle, ShmHandle

__all__ = ["SHM_DIR", "CudaIpcMapping", "Mapping", "MemfdMapping", "Opener", "ShmMapping"]

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class Mapping(Protocol):
    """A piece of engine memory mapped into the daemon."""

    address: int
    size: int
    identity: tuple[object, ...]  # the same memory has the same identity, whatever name reached it
    device: str  # "cpu" (host memory) or "cuda:N"

    def tensor(self) -> Any:
        """The whole mapping as a 1-D uint8 tensor on its device (torch), for the device path's views."""

    def check(self) -> None:
        """Raise BadRequest if the memory can no longer be used safely."""

    def close(self) -> None:
        """Unmap; the address is invalid afterwards."""


class ShmMapping:
    """A named POSIX shared-memory segment, mapped read-write and shared with the engine."""

    def __init__(self, name: str, size: int, shm_dir: str = SHM_DIR) -> None:
        if not _SHM_NAME.fullmatch(name.lstrip("/")) or name.lstrip("/") in (".", ".."):
            raise BadRequest(f"shared-memory name {_clip(name)!r} is not a plain segment name")
        path = os.path.join(shm_dir, name.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise BadRequest(f"cannot open shared memory {name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"shared memory {name!r} is not a regular segment")
            if size > st.st_size:
                raise BadRequest(f"shared memory {name!r} has {st.st_size} bytes, region claims {size}")
            # Backed by the engine that made it (the daemon allocates no client pages: memory/backing.py).
            require_shmem(fd, f"shared memory {name!r}")
            require_backed(fd, f"shared memory {name!r}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # Kept open to notice a segment shrunk behind the daemon's back before the next transfer touches it.
        self._fd = fd
        self._view = (ctypes.c_char * size).from_buffer(self._mm)
        self.address = ctypes.addressof(self._view)
        self.size = size
        self.name = name
        self.identity: tuple[object, ...] = ("shm", st.st_dev, st.st_ino)
        self.device = "cpu"
        self._populator = Populator(self.address, size, f"shared memory {name!r}", self._fd)

    def tensor(self) -> Any:
        """The segment as a CPU tensor, without a copy."""
        return host_tensor(self.address, self.size)

    def check(self) -> None:
        """Refuse a segment that shrank or lost pages since registration: the daemon would crash or pay for them."""
        backed, now = backed_bytes(self._fd)
        if now < self.size:
            raise BadRequest(
                f"shared memory {self.name!r} shrank to {now} bytes after registration ({self.size} mapped): "
                "this session's memory cannot be used any more"
            )
        if backed < now:
            raise BadRequest(
                f"shared memory {self.name!r} lost pages after registration ({backed} of {now} bytes backed: holes "
                "were punched in it): this session's memory cannot be used any more"
            )

    def close(self) -> None:
        """Unmap the segment (the engine owns and unlinks it)."""
        self._populator.stop()
        del self._view
        self._mm.close()
        os.close(self._fd)


class CudaIpcMapping:
    """A CUDA allocation of another process, opened through torch's IPC handles on the daemon's own device `ordinal`
    (the engine's index for the device means nothing here: each rank may see its GPU as cuda:0)."""

    def __init__(self, handle: CudaHandle, size: int, ordinal: int) -> None:
        try:
            import torch
            from torch.multiprocessing.reductions import rebuild_cuda_tensor
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise BadRequest(f"CUDA IPC needs torch: {exc}") from None
        if not torch.cuda.is_available():
            raise BadRequest("CUDA IPC region on a daemon without a CUDA device")
        if size > handle.storage_size:
            raise BadRequest(f"CUDA storage has {handle.storage_size} bytes, region claims {size}")
        try:
            self._tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
                torch.Tensor,
                (handle.storage_size,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                ordinal,
                handle.handle,
                handle.storage_size,
                handle.storage_offset,
                False,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle,
                handle.event_sync_required,
            )
        except RuntimeError as exc:
            raise BadRequest(f"cannot open CUDA IPC handle: {exc}") from None
        self.address = int(self._tensor.data_ptr())
        self.size = size
        self.identity: tuple[object, ...] = ("cuda", ordinal, bytes(handle.handle), handle.storage_offset)
        self.device = f"cuda:{ordinal}"

    def tensor(self) -> Any:
        """The allocation as a 1-D uint8 tensor on its device (what the device path's views are cut from)."""
        return self._tensor[: self.size]

    def check(self) -> None:
        """CUDA allocations cannot shrink under an open IPC handle."""

    def close(self) -> None:
        """Drop the reference; torch closes the IPC handle when the last one goes."""
        del self._tensor


class Opener:
    """Opens the mappings of one registration: the memfds its session passed, and the handles its rights allow.

    fds are the memfds the session passed over its side socket, in order; shm_names says whether /dev/shm names are
    accepted from this session (only from trusted ranks: a named segment can be truncated under a transfer).
    """

    def __init__(
        self,
        fds: Sequence[int] = (),
        *,
        shm_names: bool = False,
        shm_dir: str = SHM_DIR,
        cuda: Callable[[CudaHandle], int] | None = None,
    ) -> None:
        """cuda gives the daemon's ordinal of the GPU a CUDA handle's memory is on (waiting until the GPU path can
        take CUDA memory), or raises why it cannot; without it CUDA regions are refused."""
        self._fds = fds
        self._shm_names = shm_names
        self._shm_dir = shm_dir
        self._cuda = cuda

    def key(self, i: int, handle: Handle | None) -> str:
        """What identifies region i's mapping within the registration (views of one segment share it)."""
        if isinstance(handle, MemfdHandle):
            if not 0 <= handle.index < len(self._fds):
                raise BadRequest(
                    f"region {i}: memfd index {handle.index}, but the session passed {len(self._fds)} memfds over "
                    "its side socket"
                )
            return f"memfd:{handle.index}"
        if isinstance(handle, ShmHandle):
            if not self._shm_names:
                raise Forbidden(
                    f"region {i}: /dev/shm names are for trusted ranks only (this session has no shm_names right): "
                    "pass sealed memfds over the side socket (kvsidecar_client.shared_tensor does)"
                )
            if not handle.name:
                raise BadRequest(f"region {i}: shared-memory name is empty")
            return "shm:" + handle.name
        if isinstance(handle, CudaHandle):
            return f"cuda:{handle.device_uuid or handle.device}:{handle.handle.hex()}:{handle.storage_offset}"
        raise BadRequest(f"region {i}: needs a shm or cuda handle, or a memfd")

    def open(self, handle: Handle | None, size: int) -> Mapping:
        """Map size bytes of the memory a handle (already accepted by key) names."""
        if isinstance(handle, MemfdHandle):
            return MemfdMapping(self._fds[handle.index], handle.index, size)
        if isinstance(handle, ShmHandle):
            return ShmMapping(handle.name, size, self._shm_dir)
        if isinstance(handle, CudaHandle):
            if self._cuda is None:
                raise BadRequest("CUDA memory, but this daemon has no GPU path: register host memory instead")
            # The contexts start in the background: a registration right after the daemon's start waits for them.
            return CudaIpcMapping(handle, size, self._cuda(handle))
        raise BadRequest("a region needs a shm or cuda handle, or a memfd")


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
