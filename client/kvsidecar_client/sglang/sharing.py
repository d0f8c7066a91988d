"""Sharing a host pool of SGLang's with the daemon in place: its buffers moved into sealed memfds at the same
addresses (`remapping.remap`), so pages move zero-copy by host index.

Which pools: those SGLang's own allocators made (`HostTensorAllocator`: an anonymous mmap, shared or private;
`ShmHostTensorAllocator`: an mmap of a memfd made without MFD_ALLOW_SEALING): each buffer is an mmap made for it
alone, which `remap` checks page by page. Not: another library's allocator (Mooncake, Mori, TensorCast: their
memory is theirs), hugetlb pages, and memory pinned by a driver (cudaHostAlloc, ROCm's hipHostMalloc): those keep
the staging copy, as does every pool with `zero_copy: false`.

When: at `register_mem_pool_host` / `register_mem_host_pool_v2`, on SGLang's control path. SGLang attaches a
storage backend while its host pools are idle: at start, from the cache controller's constructor, before the
scheduler serves anything; at run time (`/attach_hicache_storage_backend`) only on a fully idle scheduler
(`Scheduler.attach_hicache_storage_wrapped` refuses otherwise), and its storage threads, started just before the
hybrid controller registers its side pools, have no operation queued until a request comes. So nothing reads or
writes a pool while it moves.

A pool SGLang pinned for the GPU (`pin_memory`: cudaHostRegister of each buffer, in ranges it records on the tensor
as `_sglang_cuda_host_registered_ranges`) is unregistered range by range before the move and registered again
after, at the same addresses, through `torch.cuda.cudart()`: a registration made before the move would pin the old
pages, and the GPU would read and write memory the pool no longer uses. On ROCm a registered range's device address
may change with a new registration, so pinned pools there stay staged. Not run here (no GPU on this machine);
docs/sglang.md says so.

What the move leaves behind: SGLang's `pool.fd` (shm allocator) stays open but backs nothing any more (its pages
were punched out as the move went; nothing in SGLang 0.5.23 reads `pool.fd`), and truncating it affects nobody; the
new memfd is the rank's own and sealed, so nobody can shrink it under the daemon. SGLang's own munmap at teardown
unmaps the new mapping; its pages go when the client has closed its descriptor and the daemon its mapping.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvsidecar_client.remapping import NotRemappable, RemapFailed, remap

if TYPE_CHECKING:
    import torch

__all__ = ["share_pool"]

logger = logging.getLogger(__name__)

# Where SGLang's `_cuda_host_register` (mem_cache/pool_host/common.py) records the (address, bytes) ranges it pinned.
_PINNED_RANGES = "_sglang_cuda_host_registered_ranges"


def share_pool(pool: Any, buffers: Sequence[torch.Tensor]) -> str | None:
    """Move each buffer of a host pool into a sealed memfd in place: None when all moved, else why the pool stays
    staged (every byte intact either way)."""
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator, ShmHostTensorAllocator

    allocator = type(pool.allocator)
    if allocator not in (HostTensorAllocator, ShmHostTensorAllocator):
        return f"its memory comes from {allocator.__name__}, not SGLang's own mmap or shm allocator"
    for buffer in buffers:
        ranges: list[tuple[int, int]] = []
        if pool.pin_memory:
            import torch

            if torch.version.hip:
                return "it is pinned for a ROCm GPU, where a new registration may move its device address"
            ranges = list(getattr(buffer, _PINNED_RANGES, None) or [])
            if not ranges:
                return "it is pinned memory the driver allocated (cudaHostAlloc), not SGLang's cudaHostRegister"
        try:
            with _unpinned(ranges):
                remap(buffer)
        except RemapFailed as error:
            logger.warning("kvsidecar: a host pool buffer stays staged: %s", error)
            return str(error)
        except NotRemappable as error:
            return str(error)
    return None


@contextlib.contextmanager
def _unpinned(ranges: list[tuple[int, int]]) -> Iterator[None]:
    """Unregister SGLang's pinned ranges for the block and register them again after it, whatever happened."""
    if not ranges:
        yield
        return
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    released: list[tuple[int, int]] = []
    try:
        for address, size in reversed(ranges):
            code = int(cudart.cudaHostUnregister(address))
            if code:
                raise NotRemappable(f"cudaHostUnregister({address:#x}) failed ({code}); the pool stays as it was")
            released.append((address, size))
        yield
    finally:
        for address, size in reversed(released):
            code = int(cudart.cudaHostRegister(address, size, 0))
            if code:
                # SGLang's device copies need these pages pinned: never let it run on without them.
                raise RuntimeError(f"cudaHostRegister({address:#x}, {size}) failed ({code}) after moving the pool")
