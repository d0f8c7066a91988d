"""What client memory the daemon maps: shmem only, every page already allocated by the client, never by the daemon.

The daemon never allocates pages of a client's memory. A page the daemon faults in is charged to the daemon's
memory cgroup, not the rank's (measured on this kernel: a rank's fallocated 256 MiB memfd is charged to the rank;
after the rank punches it out, the daemon's reads and writes of it fault 256 MiB back in, charged to the daemon), so
a sparse memfd the daemon backed, or a hole it faults in, is memory a rank spends on the daemon's account. Hence:

- a region is accepted only on shmem (tmpfs: memfds, /dev/shm). hugetlbfs is refused: a hole punched in a hugetlb
  file after registration faults from the huge-page pool, and an empty pool is a SIGBUS in the daemon; so is any
  other filesystem (a page cache the daemon cannot reason about);
- a region must be fully backed when registered (its blocks cover its size); the refusal says how to back it;
- a backed mapping is checked again (one fstat) before each store call, so a rank that punched holes is refused
  from then on; one punching during a transfer makes the daemon fault at most that session's registered bytes back
  in, which the per-account and daemon-wide caps on registered bytes bound (tenancy/shares.py).

`st_blocks` is the measure, not SEEK_HOLE: on shmem, fallocated pages that were never written read as holes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from kvsidecar.errors import BadRequest

__all__ = ["HUGETLBFS_MAGIC", "TMPFS_MAGIC", "backed_bytes", "filesystem_type", "require_backed", "require_shmem"]

TMPFS_MAGIC = 0x01021994  # shmem: memfds without MFD_HUGETLB, /dev/shm
HUGETLBFS_MAGIC = 0x958458F6
_NAMES = {TMPFS_MAGIC: "shmem (tmpfs)", HUGETLBFS_MAGIC: "hugetlbfs", 0xEF53: "ext4", 0x58465342: "xfs"}
_STATFS_BYTES = 256  # larger than struct statfs on every 64-bit Linux; f_type (a long) comes first

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.fstatfs.restype = ctypes.c_int


def filesystem_type(fd: int) -> int:
    """The f_type of the filesystem holding fd (fstatfs(2)); Python's os has no fstatfs."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little", signed=True) & 0xFFFFFFFF


def require_shmem(fd: int, name: str) -> None:
    """BadRequest unless fd is a file on shmem (a memfd without MFD_HUGETLB, or a /dev/shm segment)."""
    try:
        kind = filesystem_type(fd)
    except OSError as exc:
        raise BadRequest(f"{name}: cannot tell its filesystem: {exc.strerror}") from None
    if kind != TMPFS_MAGIC:
        what = _NAMES.get(kind, f"filesystem type {kind:#x}")
        raise BadRequest(
            f"{name} is on {what}, not shmem: the daemon maps only memfds (memfd_create without MFD_HUGETLB) and "
            "/dev/shm segments; a hole in hugetlbfs or any other file crashes whoever touches it"
        )


def backed_bytes(fd: int) -> tuple[int, int]:
    """(bytes with pages allocated, size) of a shmem file."""
    st = os.fstat(fd)
    return st.st_blocks * 512, st.st_size


def require_backed(fd: int, name: str) -> None:
    """BadRequest unless every page of the shmem file fd is allocated, naming the fix: the client backs its memory."""
    backed, size = backed_bytes(fd)
    if backed < size:
        raise BadRequest(
            f"{name} is not fully backed: {backed} of its {size} bytes have pages, and the daemon never allocates a "
            "client's memory: back every page before registering it (posix_fallocate(fd, 0, size), as "
            "kvsidecar_client.shared_tensor does)"
        )
