"""Engine memory the daemon maps: sealed memfds, shared-memory and CUDA IPC mappings, strided regions, every address.

Nothing else in the daemon computes an address. A block id becomes an address only here, after a bounds check
against the region it falls in, and a mapping is unmapped only when no store call is using it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from kvsidecar.errors import BadRequest, Forbidden
from kvsidecar.memfd import MemfdMapping, fully_backed
from kvsidecar.values import CudaHandle, MemfdHandle, RegionRequest, ShmHandle
from kvsidecar_contract.limits import MAX_REGIONS

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class Mapping(Protocol):
    """A piece of engine memory mapped into the daemon."""

    address: int
    size: int
    identity: tuple[object, ...]  # the same memory has the same identity, whatever name reached it

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
            # Give every page its backing now: touching a hole of a sparse segment on a full /dev/shm is a SIGBUS.
            # The client backs its segments when it makes them; a backed one is not walked again (see memfd.py).
            try:
                if not fully_backed(fd):
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise BadRequest(f"cannot back shared memory {name!r} with {size} bytes: {exc.strerror}") from None
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

    def check(self) -> None:
        """Refuse a segment that shrank since registration: its missing pages would crash the daemon (SIGBUS)."""
        now = os.fstat(self._fd).st_size
        if now < self.size:
            raise BadRequest(
                f"shared memory {self.name!r} shrank to {now} bytes after registration ({self.size} mapped): "
                "this session's memory cannot be used any more"
            )

    def close(self) -> None:
        """Unmap the segment (the engine owns and unlinks it)."""
        del self._view
        self._mm.close()
        os.close(self._fd)


class CudaIpcMapping:
    """A CUDA allocation of another process, opened through torch's IPC handles."""

    def __init__(self, handle: CudaHandle, size: int) -> None:
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
                handle.device,
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
        self.identity: tuple[object, ...] = ("cuda", handle.device, bytes(handle.handle), handle.storage_offset)

    def check(self) -> None:
        """CUDA allocations cannot shrink under an open IPC handle."""

    def close(self) -> None:
        """Drop the reference; torch closes the IPC handle when the last one goes."""
        del self._tensor


@dataclass(frozen=True, slots=True)
class Region:
    """One strided view of a mapping: block b is [offset + b * stride, + block_bytes)."""

    mapping: Mapping
    offset: int
    stride: int
    block_bytes: int
    num_blocks: int
    groups: tuple[int, ...]

    def address(self, block_id: int) -> int:
        """The address of block_id's slice; the caller has checked block_id < num_blocks."""
        return self.mapping.address + self.offset + block_id * self.stride


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """A region as a request describes it, before mapping."""

    handle_key: str  # identifies the mapping, so views of one segment share it
    open_mapping: Callable[[int], Mapping]
    mapping_bytes: int
    offset: int
    stride: int
    block_bytes: int
    num_blocks: int
    groups: tuple[int, ...]


def region_specs(
    regions: Sequence[RegionRequest], fds: Sequence[int] = (), *, shm_names: bool = True
) -> list[RegionSpec]:
    """The regions of a RegisterMemory request with how each one's memory is opened (mapped later, by SessionMemory).

    fds are the memfds the session passed over its side socket, in order; shm_names says whether /dev/shm names
    are accepted from this session (only from trusted ranks: a named segment can be truncated under a transfer).
    """
    out = []
    for i, r in enumerate(regions):
        handle = r.handle
        if isinstance(handle, MemfdHandle):
            if not 0 <= handle.index < len(fds):
                raise BadRequest(
                    f"region {i}: memfd index {handle.index}, but the session passed {len(fds)} memfds over its "
                    "side socket"
                )
            key = f"memfd:{handle.index}"
            opener: Callable[[int], Mapping] = partial(MemfdMapping, fds[handle.index], handle.index)
        elif isinstance(handle, ShmHandle):
            if not shm_names:
                raise Forbidden(
                    f"region {i}: /dev/shm names are for trusted ranks only (the tenant has no shm_names right): "
                    "pass sealed memfds over the side socket (kvsidecar_client.shared_tensor does)"
                )
            if not handle.name:
                raise BadRequest(f"region {i}: shared-memory name is empty")
            key = "shm:" + handle.name
            opener = partial(ShmMapping, handle.name)
        elif isinstance(handle, CudaHandle):
            key = f"cuda:{handle.device}:{handle.handle.hex()}:{handle.storage_offset}"
            opener = partial(CudaIpcMapping, handle)
        else:
            raise BadRequest(f"region {i}: needs a shm or cuda handle, or a memfd")
        out.append(RegionSpec(key, opener, r.mapping_bytes, r.offset, r.stride, r.block_bytes, r.num_blocks, r.groups))
    return out


class SessionMemory:
    """All regions of one session, grouped per KV-cache group in registration order."""

    def __init__(self, specs: Sequence[RegionSpec], num_groups: int) -> None:
        if not specs:
            raise BadRequest("RegisterMemory needs at least one region")
        if len(specs) > MAX_REGIONS:
            raise BadRequest(f"at most {MAX_REGIONS} regions per session, got {len(specs)}")
        for i, spec in enumerate(specs):
            _check_spec(i, spec, num_groups)
        covered = {g for spec in specs for g in spec.groups}
        missing = sorted(set(range(num_groups)) - covered)
        if missing:
            raise BadRequest(f"groups {missing} have no region: every group needs at least one")
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False
        # Views of one segment share its mapping, opened once at the largest size any of them needs.
        sizes: dict[str, int] = {}
        for spec in specs:
            sizes[spec.handle_key] = max(sizes.get(spec.handle_key, 0), spec.mapping_bytes)
        opener = {spec.handle_key: spec.open_mapping for spec in specs}
        self.mappings: dict[str, Mapping] = {}
        try:
            for key, size in sizes.items():
                self.mappings[key] = opener[key](size)
        except BaseException:
            for m in self.mappings.values():
                m.close()
            raise
        self.groups: list[list[Region]] = [[] for _ in range(num_groups)]
        for spec in specs:
            region = Region(
                self.mappings[spec.handle_key], spec.offset, spec.stride, spec.block_bytes, spec.num_blocks, spec.groups
            )
            for g in spec.groups:
                self.groups[g].append(region)
        self.value_bytes = [sum(r.block_bytes for r in regions) for regions in self.groups]
        self.mapped_bytes = sum(m.size for m in self.mappings.values())
        # Per group, computed once: a save or load asks for one address per region for every block it moves
        # (61 regions x hundreds of blocks for an MLA model), so this is the data path's innermost loop.
        self._blocks_in_group = [min(r.num_blocks for r in regions) for regions in self.groups]
        self._bases = [[r.mapping.address + r.offset for r in regions] for regions in self.groups]
        self._strides = [[r.stride for r in regions] for regions in self.groups]
        self._stride = [_common(strides) for strides in self._strides]
        self._sizes = [tuple(r.block_bytes for r in regions) for regions in self.groups]

    def buffers(self, group: int, block_id: int) -> tuple[list[int], list[int]]:
        """Addresses and sizes of a block's slices in every region of its group (one stored value)."""
        if not 0 <= block_id < self._blocks_in_group[group]:
            self._out_of_bounds(group, block_id)
        stride = self._stride[group]
        if stride is not None:
            offset = block_id * stride
            addresses = [base + offset for base in self._bases[group]]
        else:
            addresses = [base + block_id * s for base, s in zip(self._bases[group], self._strides[group], strict=True)]
        return addresses, list(self._sizes[group])

    def _out_of_bounds(self, group: int, block_id: int) -> None:
        for i, region in enumerate(self.groups[group]):
            if not 0 <= block_id < region.num_blocks:
                raise BadRequest(
                    f"group {group}: block id {block_id} is outside region {i} of the group "
                    f"({region.num_blocks} blocks)"
                )

    def acquire(self) -> None:
        """Hold the mappings for a store call; raises once the session is closing or its memory became unsafe."""
        with self._lock:
            if self._closed:
                raise BadRequest("the session's memory is being released")
            for m in self.mappings.values():
                m.check()
            self._in_flight += 1

    def release(self) -> None:
        """End a store call started with acquire()."""
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()

    def close(self, unregister: Callable[[int], None] | None = None) -> None:
        """Unmap everything once in-flight store calls are done; later acquire() calls fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Unmapping under a running transfer would crash the daemon: wait for them (they are bounded).
            self._lock.wait_for(lambda: self._in_flight == 0)
        for m in self.mappings.values():
            if unregister is not None:
                unregister(m.address)
            m.close()


def _common(values: Sequence[int]) -> int | None:
    """The one value all of values share, else None."""
    first = values[0] if values else None
    return first if all(v == first for v in values) else None


class MappingOwners:
    """Which session maps which memory: a session may only register memory no other live session has."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[tuple[object, ...], str] = {}

    def claim(self, session_id: str, memory: SessionMemory) -> None:
        """Record the session as owner of its mappings, or raise Forbidden if another session owns one."""
        with self._lock:
            for m in memory.mappings.values():
                owner = self._owner.get(m.identity)
                if owner is not None and owner != session_id:
                    raise Forbidden(
                        f"memory {getattr(m, 'name', m.identity[0])!r} is registered by another session: "
                        "a session registers only memory of its own"
                    )
            for m in memory.mappings.values():
                self._owner[m.identity] = session_id

    def release(self, session_id: str, memory: SessionMemory) -> None:
        """Forget the session's claims."""
        with self._lock:
            for m in memory.mappings.values():
                if self._owner.get(m.identity) == session_id:
                    del self._owner[m.identity]


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _check_spec(i: int, spec: RegionSpec, num_groups: int) -> None:
    where = f"region {i}"
    if spec.num_blocks < 1:
        raise BadRequest(f"{where}: num_blocks must be >= 1")
    if spec.block_bytes < 1:
        raise BadRequest(f"{where}: block_bytes must be >= 1")
    if spec.num_blocks > 1 and spec.stride < spec.block_bytes:
        raise BadRequest(f"{where}: block_stride {spec.stride} is smaller than block_bytes {spec.block_bytes}")
    end = spec.offset + (spec.num_blocks - 1) * spec.stride + spec.block_bytes
    if end > spec.mapping_bytes:
        raise BadRequest(f"{where}: its last block ends at byte {end}, past the mapping's {spec.mapping_bytes} bytes")
    if not spec.groups:
        raise BadRequest(f"{where}: names no group")
    bad = [g for g in spec.groups if not 0 <= g < num_groups]
    if bad:
        raise BadRequest(f"{where}: group index {bad[0]} out of range (session has {num_groups} groups)")
    if len(set(spec.groups)) != len(spec.groups):
        raise BadRequest(f"{where}: lists a group twice")
