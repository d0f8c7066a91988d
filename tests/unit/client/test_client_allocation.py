"""CPU allocations inside SharedMemoryAllocation land in named shared memory; a too small /dev/shm fails early."""

import os

import pytest
import torch

import kvsidecar_client.memory as memory
from kvsidecar_client import SharedMemoryFull, shared_tensor
from kvsidecar_client.allocation import SharedMemoryAllocation
from kvsidecar_client.memory import SHM_DIR, segment_of


def test_vllm_cpu_kv_allocation_is_served_from_shared_memory():
    with SharedMemoryAllocation() as allocation:
        # What vLLM's allocate_kv_cache does on CPU: one int8 buffer, every layer a view of it.
        buf = torch.zeros(4096, dtype=torch.int8, device="cpu")
        other = torch.empty((2, 3), dtype=torch.float32)
        kept = torch.ones(8)  # not an allocator this context serves
    segment = segment_of(buf)
    assert segment is not None and segment.size == 4096
    assert os.path.exists(os.path.join(SHM_DIR, segment.name))
    assert (buf == 0).all() and buf.dtype == torch.int8 and buf.shape == (4096,)
    assert segment_of(buf.view(16, 256)[3]) == segment  # vLLM's per-layer views
    assert segment_of(other) is not None and other.shape == (2, 3)
    assert segment_of(kept) is None
    assert [t.data_ptr() for t in allocation.tensors] == [buf.data_ptr(), other.data_ptr()]
    # Outside the context torch allocates as always.
    assert segment_of(torch.zeros(16, dtype=torch.int8)) is None


def test_what_shared_memory_cannot_hold_keeps_torchs_allocator():
    with SharedMemoryAllocation():
        grad = torch.zeros(4, requires_grad=True)
        out = torch.empty(4)
        into = torch.zeros(4, out=out)
        empty = torch.zeros(0)
    assert segment_of(grad) is None
    assert segment_of(empty) is None
    assert segment_of(into) is segment_of(out)


def test_a_too_small_dev_shm_fails_naming_the_size_and_the_fix(monkeypatch):
    real = os.statvfs(SHM_DIR)

    class Small:
        f_frsize = 4096
        f_blocks = 16384  # 64 MiB: Docker's default /dev/shm
        f_bavail = 16000

    monkeypatch.setattr(memory.os, "statvfs", lambda path: Small() if path == SHM_DIR else real)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(SharedMemoryFull) as error, SharedMemoryAllocation():
        torch.zeros(3 * 2**30, dtype=torch.int8)
    message = str(error.value)
    assert "3221225472 bytes (3.00 GiB)" in message
    assert "--shm-size=4g" in message, message
    assert "medium: Memory" in message and "sizeLimit: 4Gi" in message
    assert set(os.listdir(SHM_DIR)) - before == set(), "a refused segment must not be left behind"


def test_enospc_from_the_filesystem_is_the_same_error(monkeypatch):
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memory.os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryFull, match="--shm-size"):
        shared_tensor(4096, torch.int8)
