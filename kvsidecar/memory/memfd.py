"""Sealed memfds a rank passed over the side socket, mapped into the daemon."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat

from kvsidecar.errors import BadRequest

__all__ = ["MemfdMapping", "fully_backed"]


def fully_backed(fd: int) -> bool:
    """Whether every page of a tmpfs file (memfd, /dev/shm) is allocated: its blocks count the allocated pages."""
    st = os.fstat(fd)
    return st.st_blocks * 512 >= st.st_size


class MemfdMapping:
    """A memfd passed over the side socket, sealed against shrinking: its pages cannot vanish under a transfer.

    That is what makes CPU memory safe to map from a rank the daemon does not trust: a /dev/shm segment can be
    truncated while a transfer runs (SIGBUS in the daemon), a memfd with F_SEAL_SHRINK cannot, by anyone.
    """

    def __init__(self, fd: int, index: int, size: int) -> None:
        self.name = f"memfd #{index}"
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise BadRequest(f"{self.name} is not a sealable memfd: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"{self.name} is not a memfd")
        if not seals & fcntl.F_SEAL_SHRINK:
            # Sealing it here is as good as the engine doing it: seals are never removed, by anyone.
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            except OSError as exc:
                raise BadRequest(
                    f"{self.name} is not sealed against shrinking (F_SEAL_SHRINK) and cannot be: {exc.strerror}"
                ) from None
        size_now = os.fstat(fd).st_size
        if size > size_now:
            raise BadRequest(f"{self.name} has {size_now} bytes, region claims {size}")
        try:
            # Backing every page now keeps a later fault on a full memory cgroup out of the transfer. The client
            # backs its memfds before sealing them; walking a backed GiB again is not free (0.1 s idle, and 80-125 s
            # for two 1 GiB caches at once on a loaded 2-core machine, past the rank's RegisterMemory deadline).
            if not fully_backed(fd):
                os.posix_fallocate(fd, 0, size)
            # mmap keeps its own duplicate of the descriptor; the session closes the one it was handed.
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise BadRequest(f"cannot map {self.name} read-write ({size} bytes): {exc.strerror}") from None
        self._view = (ctypes.c_char * size).from_buffer(self._mm)
        self.address = ctypes.addressof(self._view)
        self.size = size
        self.identity: tuple[object, ...] = ("memfd", st.st_dev, st.st_ino)

    def check(self) -> None:
        """A memfd sealed against shrinking stays whole for as long as it is mapped."""

    def close(self) -> None:
        """Unmap it; the engine's own mapping is untouched."""
        del self._view
        self._mm.close()
