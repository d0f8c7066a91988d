"""What client memory the daemon maps: shmem only, fully backed by its owner, and checked again before each use."""

from __future__ import annotations

import ctypes
import fcntl
import os
import tempfile

import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.memory.backing import HUGETLBFS_MAGIC, TMPFS_MAGIC, filesystem_type, require_shmem
from kvsidecar.memory.memfd import MemfdMapping

SIZE = 64 * 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def memfd(backed: bool = True, flags: int = 0) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, SIZE)
    if backed:
        os.posix_fallocate(fd, 0, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_memfds_and_dev_shm_are_shmem_and_a_disk_file_is_refused():
    fd = memfd()
    try:
        assert filesystem_type(fd) == TMPFS_MAGIC
        require_shmem(fd, "memfd #0")
    finally:
        os.close(fd)
    with (
        tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(__file__))) as f,
        pytest.raises(BadRequest, match=r"memfd #1 is on .*, not shmem"),
    ):
        require_shmem(f.fileno(), "memfd #1")


def test_a_hugetlb_memfd_is_refused():
    try:
        fd = os.memfd_create("h", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"this kernel makes no hugetlb memfd: {exc.strerror}")
    try:
        assert filesystem_type(fd) == HUGETLBFS_MAGIC
        with pytest.raises(BadRequest, match="memfd #0 is on hugetlbfs, not shmem"):
            MemfdMapping(fd, 0, 1)
    finally:
        os.close(fd)


def test_a_sparse_memfd_is_refused_and_left_sparse():
    fd = memfd(backed=False)
    try:
        with pytest.raises(BadRequest, match=r"not fully backed: 0 of its 65536 bytes have pages.*posix_fallocate"):
            MemfdMapping(fd, 0, SIZE)
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(fd)


def test_a_hole_punched_after_registration_refuses_the_memory_from_then_on():
    fd = memfd()
    try:
        mapping = MemfdMapping(fd, 0, SIZE)
        mapping.check()
        assert _libc.fallocate(fd, PUNCH, 4096, 4096) == 0
        with pytest.raises(BadRequest, match=r"memfd #0 lost pages after registration \(61440 of 65536"):
            mapping.check()
        mapping.close()
    finally:
        os.close(fd)
