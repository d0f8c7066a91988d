"""The daemon fills in its page tables for a rank's memory at registration, and never allocates a page of it."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

from kvsidecar.memory.backing import backed_bytes
from kvsidecar.memory.memfd import MemfdMapping
from kvsidecar.memory.populate import Populator

MIB = 1 << 20


def memfd(size: int, *, backed: bool = True) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if backed:
        os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def resident(address: int, size: int) -> int:
    """Bytes of this process's mappings in [address, address + size) that have page-table entries (smaps' Rss).

    Summed over every mapping in the range: the kernel may split one mapping into several.
    """
    total = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                low, high = (int(x, 16) for x in head[0].split("-"))
                inside = low < address + size and address < high
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def populated(address: int, size: int) -> bool:
    """Whether the range is populated: all of it but what reclaim may have taken back since.

    Under memory pressure the kernel may unmap a few pages of a shmem mapping again (a CI run found 2 pages of
    96 MiB gone); unpopulated, an untouched mapping has none.
    """
    return resident(address, size) >= size - size // 16


def test_a_registered_memfd_is_populated_in_the_background_before_any_transfer_touches_it():
    size = 96 * MIB  # three chunks: populated on the populator's thread
    fd = memfd(size)
    try:
        mapping = MemfdMapping(fd, 0, size)
        try:
            assert mapping._populator.done.wait(60)
            assert mapping._populator.bytes == size
            assert populated(mapping.address, size), resident(mapping.address, size)
        finally:
            mapping.close()
    finally:
        os.close(fd)


def test_a_small_memfd_is_populated_before_registration_returns():
    fd = memfd(MIB)
    try:
        mapping = MemfdMapping(fd, 0, MIB)
        try:
            assert mapping._populator.done.is_set()
            assert populated(mapping.address, MIB), resident(mapping.address, MIB)
        finally:
            mapping.close()
    finally:
        os.close(fd)


def test_memory_with_holes_is_not_populated_so_the_daemon_allocates_none_of_it():
    size = 4 * MIB
    fd = memfd(size, backed=False)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = (ctypes.c_char * size).from_buffer(mm)
    try:
        populator = Populator(ctypes.addressof(view), size, "memfd #0", fd)
        assert populator.done.is_set()
        assert populator.bytes == 0
        assert backed_bytes(fd) == (0, size)  # still sparse: nothing was faulted in on the daemon's account
    finally:
        del view
        mm.close()
        os.close(fd)


def test_closing_stops_the_populator_before_unmapping():
    size = 256 * MIB
    fd = memfd(size)
    try:
        mapping = MemfdMapping(fd, 0, size)
        mapping.close()  # returns once the populator's thread has stopped: nothing touches the unmapped range
        assert mapping._populator.done.is_set()
        assert mapping._populator.bytes <= size
    finally:
        os.close(fd)
