"""A CPU tensor's own pages moved, in place, into a sealed memfd the daemon can map (zero-copy for memory we did not
allocate).

Memory another library allocated cannot be handed to the daemon as it is: a memfd made without MFD_ALLOW_SEALING
(SGLang's shm allocator) can be shrunk under a transfer whenever its owner likes, a SIGBUS that kills the daemon and
every engine's store with it, and anonymous memory (SGLang's mmap allocator) has no descriptor to pass at all.
`remap` gives such a tensor what `shared_tensor` gives its own: it copies the tensor's pages into a new memfd with
MFD_ALLOW_SEALING and maps that memfd over the same virtual range (MAP_FIXED), so every pointer and tensor the
library holds into the range stays valid and now reads and writes the new pages; then it seals the memfd against
shrinking and growing and registers it like `shared_tensor`'s (`memory.track_memfd`): the client passes it to the
daemon over the side socket, and the process owns the only descriptor, which nothing can shrink.

It moves the range a chunk at a time (copy the chunk into the memfd, drop the old chunk's pages, map the new ones
over it), so the process holds at most one chunk twice. The old pages go back as each chunk moves: shared memory
(a memfd, /dev/zero, a /dev/shm file) by MADV_REMOVE, which punches the hole in the old file itself, so an old
memfd that stays open (its owner's descriptor) keeps no memory and reads as zeros; private anonymous memory by
MADV_DONTNEED. If a chunk fails to move (no memory for the copy), the chunks before it stay moved and the rest
stays where it was: every byte is where the tensor reads it, and `RemapFailed` says so.

What the caller vouches for: nothing reads or writes the range while it moves (between a chunk's old pages going
and its new ones arriving it reads zeros), and the pages from the storage's first byte to its last page's end are
the tensor's own (an mmap made for it, as SGLang's allocators make). What can be checked is checked first
(`check_own_pages`, from /proc/self/smaps): page-aligned, rw, 4 KiB pages (no hugetlb), private anonymous or
shared shmem (memfd, /dev/zero, /dev/shm). Memory pinned for a device (cudaHostRegister) must be unpinned around
the move and pinned again after by whoever pinned it; memory a driver allocated (cudaHostAlloc) is never remapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.memory import SharedMemory, segment_of, track_memfd

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "NotRemappable", "RemapFailed", "Vma", "check_own_pages", "remap"]

PAGE = mmap.PAGESIZE
DEFAULT_CHUNK_BYTES = 64 << 20  # extra memory the move holds at once
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_SHMEM_PATHS = ("/dev/zero (deleted)", "/memfd:", "/dev/shm/")
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux; Python's mmap module does not name it


class NotRemappable(InvalidRequest):
    """The tensor's pages cannot be moved (the reason says why); nothing was changed."""


class RemapFailed(NotRemappable):
    """The move stopped part way; every byte is intact where the tensor reads it, part of it in the new memfd."""


class _Lost(OSError):
    """A chunk's old pages are gone and its new ones could not be mapped."""


class Vma(NamedTuple):
    """One mapping of /proc/self/smaps: [start, end), its permissions, what backs it, its page size."""

    start: int
    end: int
    perms: str
    path: str
    page_kib: int

    @property
    def shared(self) -> bool:
        """A shared mapping (its pages belong to a file or a shmem object, not to this mapping)."""
        return self.perms[3] == "s"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def vmas(start: int, end: int, smaps: str = "/proc/self/smaps") -> list[Vma]:
    """The mappings that overlap [start, end), in address order."""
    out: list[Vma] = []
    current: list[object] | None = None
    with open(smaps, encoding="ascii", errors="replace") as file:
        for line in file:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                low, high = (int(v, 16) for v in head[0].split("-"))
                current = [low, high, head[1], head[5].strip() if len(head) > 5 else "", 0]
                if low < end and high > start:
                    out.append(Vma(low, high, head[1], str(current[3]), 0))
            elif head[0] == "KernelPageSize:" and current is not None and out and out[-1].start == current[0]:
                out[-1] = out[-1]._replace(page_kib=int(head[1]))
    return out


def check_own_pages(base: int, size: int, smaps: str = "/proc/self/smaps") -> list[Vma]:
    """The mappings of [base, base + size) if its pages can move into a memfd, else NotRemappable with the reason."""
    where = f"[{base:#x}, {base + size:#x})"
    if base % PAGE or size % PAGE or size <= 0:
        raise NotRemappable(f"{where} is not whole pages")
    found = vmas(base, base + size, smaps)
    at = base
    for vma in found:
        if vma.start > at:
            break
        if not vma.perms.startswith("rw"):
            raise NotRemappable(f"{where}: a mapping of it is {vma.perms}, not writable")
        if vma.page_kib * 1024 != PAGE:
            raise NotRemappable(f"{where}: a mapping of it has {vma.page_kib} KiB pages (hugetlb), not {PAGE // 1024}")
        if vma.shared and not vma.path.startswith(_SHMEM_PATHS):
            raise NotRemappable(f"{where}: a mapping of it is shared memory of {vma.path or 'a device'}, not shmem")
        if not vma.shared and vma.path:
            raise NotRemappable(f"{where}: a mapping of it is a private mapping of {vma.path}")
        at = vma.end
    if at < base + size:
        raise NotRemappable(f"{where} is not all mapped (mapped up to {at:#x})")
    return [v for v in found if v.start < base + size]


def _pwrite_all(fd: int, address: int, size: int, offset: int) -> None:
    view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    done = 0
    while done < size:
        done += os.pwrite(fd, view[done:], offset + done)


def _pieces(found: list[Vma], start: int, end: int) -> Iterator[tuple[int, int, bool]]:
    """(address, bytes, shared) of [start, end) per mapping."""
    for vma in found:
        low, high = max(vma.start, start), min(vma.end, end)
        if low < high:
            yield low, high - low, vma.shared


def remap(tensor: torch.Tensor, *, chunk: int = DEFAULT_CHUNK_BYTES, smaps: str = "/proc/self/smaps") -> SharedMemory:
    """Move a CPU tensor's storage, in place, into a sealed memfd the client can register; its segment.

    Already in a sealed memfd (a `shared_tensor`, or moved before): that segment, unchanged. The caller vouches
    that nothing touches the range meanwhile and that its pages are the tensor's own (the module docstring).
    """
    if tensor.device.type != "cpu":
        raise NotRemappable(f"only CPU memory can be remapped, not {tensor.device}")
    known = segment_of(tensor)
    if known is not None and known.sealed:
        return known
    storage = tensor.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    size = -(-nbytes // PAGE) * PAGE
    found = check_own_pages(base, size, smaps)
    chunk = max(PAGE, chunk - chunk % PAGE)
    libc = _libc()
    fd = os.memfd_create(f"kvsidecar-remap-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    moved = 0
    try:
        os.ftruncate(fd, size)
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            address = base + offset
            _pwrite_all(fd, address, length, offset)
            # The old pages go now, before the new ones cover them (nothing else could reach the old shmem pages).
            for piece, (low, count, shared) in enumerate(_pieces(found, address, address + length)):
                advice = mmap.MADV_REMOVE if shared else mmap.MADV_DONTNEED
                if libc.madvise(low, count, advice) != 0:
                    # Before any of the chunk's old pages went, the chunk is still whole where it was.
                    failed = _Lost if piece else OSError
                    raise failed(ctypes.get_errno(), f"madvise({low:#x}, {count}) of the old pages failed")
            flags = mmap.MAP_SHARED | _MAP_FIXED | mmap.MAP_POPULATE
            if libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset) in (None, _MAP_FAILED):
                # The chunk's old pages are gone and Linux leaves a failed MAP_FIXED range unmapped: not recoverable.
                raise _Lost(ctypes.get_errno(), f"mmap(MAP_FIXED) of {length} bytes over {address:#x} failed")
            moved = offset + length
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except _Lost as error:
        os.close(fd)
        raise OSError(error.errno, f"{error.strerror}: the tensor's memory there is lost") from None
    except OSError as error:
        # The mappings made so far hold the memfd's file; the descriptor itself is ours to close.
        os.close(fd)
        if not moved:
            raise NotRemappable(f"moving {size} bytes at {base:#x} into a memfd failed: {error}") from None
        raise RemapFailed(
            f"moving {size} bytes at {base:#x} into a memfd stopped after {moved} bytes: {error}; every byte is "
            "intact, but the range is not shareable"
        ) from None
    return track_memfd(tensor, fd, size)
