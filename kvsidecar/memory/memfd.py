"""Sealed memfds a rank passed over the side socket, mapped into the daemon."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
from typing import Any

from kvsidecar.errors import BadRequest
from kvsidecar.memory.backing import backed_bytes, require_backed, require_shmem
from kvsidecar.memory.populate import Populator
from kvsidecar.memory.slices import host_tensor

__all__ = ["MemfdMapping"]


class MemfdMapping:
    """A memfd passed over the side socket: on shmem, sealed against shrinking, and fully backed by its owner.

    That is what makes CPU memory safe to map from a rank the daemon does not trust: a /dev/shm segment can be
    truncated while a transfer runs (SIGBUS in the daemon), a memfd with F_SEAL_SHRINK cannot, by anyone; and the
    daemon allocates none of its pages (memory/backing.py says why and what a punched hole can still do).
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
        require_shmem(fd, self.name)
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
        require_backed(fd, self.name)
        # Kept to see holes punched after registration (check); mmap keeps a duplicate of its own.
        self._fd = os.dup(fd)
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(self._fd)
            raise BadRequest(f"cannot map {self.name} read-write ({size} bytes): {exc.strerror}") from None
        self._view = (ctypes.c_char * size).from_buffer(self._mm)
        self.address = ctypes.addressof(self._view)
        self.size = size
        self.identity: tuple[object, ...] = ("memfd", st.st_dev, st.st_ino)
        self.device = "cpu"
        self._populator = Populator(self.address, size, self.name, self._fd)

    def tensor(self) -> Any:
        """The memfd as a CPU tensor, without a copy."""
        return host_tensor(self.address, self.size)

    def check(self) -> None:
        """Refuse a memfd its owner punched holes in: the daemon would fault them back in on its own account."""
        backed, size = backed_bytes(self._fd)
        if backed < size:
            raise BadRequest(
                f"{self.name} lost pages after registration ({backed} of {size} bytes backed: holes were punched "
                "in it): this session's memory cannot be used any more; register fully backed memory again"
            )

    def close(self) -> None:
        """Unmap it; the engine's own mapping is untouched."""
        self._populator.stop()
        del self._view
        self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
