"""Engine memory the daemon can map: shared-memory CPU tensors (descriptions.py describes them to the daemon).

By default `shared_tensor` allocates a memfd sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL), which the client hands the daemon over its side socket (SCM_RIGHTS): nobody, this process included, can
then truncate the memory under a transfer, so no rank can crash the daemon through it. The fd lives as long as the
tensor's mapping. `named=True` makes a /dev/shm segment instead, for daemons reached over TCP (no fd passing); those
are for trusted ranks only (a truncated segment under a running transfer crashes the daemon).

Lifetime of a named `shared_tensor` segment: the segment is created here (O_CREAT|O_EXCL under /dev/shm, mode 0600) and
mapped once; the tensor's storage holds the only reference to that mapping, so the mapping lives exactly as long as
the tensor or any view of it. A `weakref.finalize` on the mapping unlinks the name when the last view dies, and at
interpreter exit for segments still alive (finalize runs at exit by itself). Unlinking removes only the name: the
daemon's own mapping stays valid until it unmaps.

Why not `multiprocessing.shared_memory.SharedMemory(create=True)`: its `close()` (also run from `__del__`) unmaps the
segment as soon as no buffer export is held, and torch does not hold one, so a tensor over `shm.buf` can outlive its
mapping. The resource-tracker half of SharedMemory is kept on purpose: each segment is registered with
`multiprocessing.resource_tracker` like SharedMemory(create=True) would, so a process killed without running its
finalizers still gets its segments unlinked, and unregistered when we unlink it ourselves. Only the creating process
does this; the daemon must open segments by path (never `SharedMemory(name)`, which on Python < 3.13 registers the
segment with the daemon's tracker too and would unlink the engine's segments when the daemon exits).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import math
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, NamedTuple

from kvsidecar_client.errors import InvalidRequest, SharedMemoryFull

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHM_DIR",
    "SharedMemory",
    "segment_of",
    "shared_tensor",
    "track_memfd",
]

SHM_DIR = "/dev/shm"  # the daemon opens SHM_DIR/<name>


class SharedMemory(NamedTuple):
    """A shared-memory segment: a sealed memfd (fd >= 0, no name) or a name under /dev/shm; its size in bytes."""

    name: str
    size: int
    fd: int = -1

    @property
    def sealed(self) -> bool:
        """A sealed memfd, passed to the daemon as a descriptor."""
        return self.fd >= 0


# storage data_ptr -> segment, for every live shared_tensor mapping; entries leave with their mapping.
_segments: dict[int, SharedMemory] = {}
_segments_lock = threading.Lock()
_counter = itertools.count()


def _release(name: str, base: int, creator_pid: int) -> None:
    with _segments_lock:
        if _segments.get(base, SharedMemory("", 0)).name == name:
            del _segments[base]
    # A forked child inherits this finalizer; only the creator may remove the name the daemon opens.
    if os.getpid() != creator_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    resource_tracker.unregister("/" + name, "shared_memory")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _reserve(fd: int, size: int) -> None:
    """Size the segment and back every page of it, or raise SharedMemoryFull naming the size and the fix."""
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    try:
        if size > free:
            raise OSError(28, "No space left on device")
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno != 28:  # ENOSPC
            raise
        total = stat.f_blocks * stat.f_frsize
        need = -(-(size + total - free) // 2**30)  # whole GiB: this segment plus what is already used
        raise SharedMemoryFull(
            f"shared memory for the KV cache needs {size} bytes ({_gib(size)}) but {SHM_DIR} has {free} bytes "
            f"({_gib(free)}) free of {_gib(total)}: give the engine a bigger {SHM_DIR} (Docker: --shm-size={need}g; "
            f"Kubernetes: an emptyDir volume with medium: Memory and sizeLimit: {need}Gi mounted at {SHM_DIR}), "
            "or make the KV cache smaller (VLLM_CPU_KVCACHE_SPACE on vLLM CPU)"
        ) from None


_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _close_fd(fd: int, base: int) -> None:
    with _segments_lock:
        if _segments.get(base, SharedMemory("", 0)).fd == fd:
            del _segments[base]
    with contextlib.suppress(OSError):
        os.close(fd)


def shared_tensor(
    shape: int | Sequence[int], dtype: torch.dtype, *, mode: int = 0o600, named: bool = False
) -> torch.Tensor:
    """A zero-filled CPU tensor in memory the daemon can map: a sealed memfd, or with named=True a /dev/shm segment.

    Sealed memfds reach the daemon over its Unix socket only; named segments also work with a TCP daemon on the
    same node, for trusted ranks (see the module docstring). mode applies to named segments.
    """
    import torch

    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if not dims or any(d < 1 for d in dims):
        raise InvalidRequest(f"a shared tensor needs a non-empty shape of positive sizes, got {shape!r}")
    numel = math.prod(dims)
    size = numel * dtype.itemsize
    if not named:
        return _sealed_tensor(dims, numel, size, dtype)
    pid = os.getpid()
    name = f"kvsidecar-{pid}-{next(_counter)}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    # O_EXCL: never adopt a segment someone else created under a guessed name.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            # Reserve every page now: tmpfs over-commits, and a page it cannot back later is a SIGBUS mid-forward.
            _reserve(fd, size)  # tmpfs pages read as zeros
            mapping = _map(fd, size)
        except BaseException:
            os.unlink(path)
            raise
    finally:
        os.close(fd)
    resource_tracker.register("/" + name, "shared_memory")
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(dims)
    base = tensor.untyped_storage().data_ptr()
    with _segments_lock:
        _segments[base] = SharedMemory(name, size)
    weakref.finalize(mapping, _release, name, base, pid)
    # From here the tensor's storage owns the only reference to the mapping.
    del mapping
    return tensor


def _map(fd: int, size: int) -> mmap.mmap:
    """The engine's mapping of its KV cache, its page tables filled in now (MAP_POPULATE: ~0.3 s/GiB here).

    A page first used through a mapping takes a fault: blocks the daemon loaded would otherwise fault in page by
    page as the forward first reads them (~15 ms per 125 MiB here, on a store hit's time to first token).
    """
    return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)


def _sealed_tensor(dims: tuple[int, ...], numel: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    fd = os.memfd_create(f"kvsidecar-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)  # memfd pages read as zeros until written
        # Back every page now, as for named segments: a page the kernel cannot back later is a SIGBUS mid-forward.
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise SharedMemoryFull(
                f"cannot back {size} bytes ({_gib(size)}) of shared memory for the KV cache: the engine's memory "
                "limit (its cgroup) is too small for it; raise the limit or make the KV cache smaller "
                "(VLLM_CPU_KVCACHE_SPACE on vLLM CPU)"
            ) from None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(dims)
    base = tensor.untyped_storage().data_ptr()
    with _segments_lock:
        _segments[base] = SharedMemory("", size, fd)
    # The descriptor is passed again at every (re-)registration, so it lives exactly as long as the mapping.
    weakref.finalize(mapping, _close_fd, fd, base)
    del mapping
    return tensor


def track_memfd(tensor: torch.Tensor, fd: int, size: int) -> SharedMemory:
    """Register a sealed memfd of `size` bytes that maps `tensor`'s storage from its first byte (remapping.py), so
    the client registers the tensor as it does shared_tensor's; the fd is closed when the tensor is collected."""
    base = tensor.untyped_storage().data_ptr()
    segment = SharedMemory("", size, fd)
    with _segments_lock:
        _segments[base] = segment
    weakref.finalize(tensor, _close_fd, fd, base)
    return segment


def segment_of(tensor: torch.Tensor) -> SharedMemory | None:
    """The segment behind a tensor (or any view of it) made by shared_tensor, else None."""
    with _segments_lock:
        return _segments.get(tensor.untyped_storage().data_ptr())
