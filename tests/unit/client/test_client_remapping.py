"""Moving a tensor's own pages in place into a sealed memfd (remapping.py): memory another library allocated, as
SGLang's allocators make it, becomes memory the client can register, at the same address and with the same bytes."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from kvsidecar_client import shared_tensor
from kvsidecar_client.descriptions import describe_region
from kvsidecar_client.memory import segment_of
from kvsidecar_client.remapping import PAGE, NotRemappable, check_own_pages, remap, vmas

SIZE = 10 * PAGE + 24  # not whole pages: the last one is the allocation's, as an mmap's always is


def _allocated(kind: str):
    """A tensor over an mmap made for it, as SGLang's allocators make it: an unsealable memfd, shared or private
    anonymous memory (and the memfd, or -1)."""
    if kind == "memfd":
        fd = os.memfd_create("sglang_host_pool_test", os.MFD_CLOEXEC)
        os.ftruncate(fd, -(-SIZE // PAGE) * PAGE)
        mapping = mmap.mmap(fd, -(-SIZE // PAGE) * PAGE, mmap.MAP_SHARED)
    else:
        fd = -1
        flags = mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE
        mapping = mmap.mmap(-1, -(-SIZE // PAGE) * PAGE, flags | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=SIZE)
    tensor.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    return tensor, fd


@pytest.mark.parametrize("kind", ["memfd", "shared", "private"])
def test_a_tensor_moves_in_place_into_a_sealed_memfd_nobody_can_shrink(kind):
    tensor, old = _allocated(kind)
    before, address = tensor.clone(), tensor.data_ptr()
    view = tensor[PAGE:]  # a view taken before the move reads the moved pages too
    segment = remap(tensor, chunk=3 * PAGE)  # four chunks, the last one short
    assert tensor.data_ptr() == address and torch.equal(tensor, before) and torch.equal(view, before[PAGE:])
    assert segment.sealed and segment.size == 11 * PAGE and segment_of(view) == segment
    assert {v.path for v in vmas(address, address + segment.size)} == {
        f"/memfd:kvsidecar-remap-{os.getpid()} (deleted)"
    }
    tensor[7] ^= 0xFF  # the tensor and the memfd are the same memory
    assert os.pread(segment.fd, 1, 7)[0] == int(tensor[7])
    with pytest.raises(PermissionError):
        os.ftruncate(segment.fd, 0)
    if old >= 0:
        # The old memfd kept nothing (its pages were punched out as the move went) and backs nothing any more.
        assert os.fstat(old).st_blocks == 0
        os.ftruncate(old, 0)
        assert torch.equal(tensor[8:], before[8:])
    assert remap(tensor) == segment  # moved once
    fds: list[int] = []
    region = describe_region(tensor[: 10 * PAGE].view(10, PAGE), [0], fds=fds)
    assert (region.memfd.index, region.mapping_bytes, fds) == (0, 11 * PAGE, [segment.fd])


def test_the_owners_munmap_and_the_tensors_end_release_the_memfd():
    tensor, _ = _allocated("shared")
    address, fd = tensor.data_ptr(), remap(tensor).fd
    assert os.fstat(fd).st_size == 11 * PAGE
    # The owner's mmap object unmaps the range when its tensor goes (SGLang's teardown): the memfd's mapping with it.
    del tensor
    gc.collect()
    assert not [v for v in vmas(address, address + 11 * PAGE) if "kvsidecar-remap" in v.path]
    with pytest.raises(OSError):
        os.fstat(fd)


def test_what_is_already_sealed_is_left_as_it_is():
    kv = shared_tensor((4, 1024), torch.float32)
    assert remap(kv) == segment_of(kv)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: torch.arange(1000, dtype=torch.uint8), "not whole pages"),
        (lambda: torch.frombuffer(mmap.mmap(-1, PAGE, prot=mmap.PROT_READ), dtype=torch.uint8), "not writable"),
        (lambda tmp: torch.frombuffer(_file_mapping(tmp, mmap.MAP_SHARED), dtype=torch.uint8), "not shmem"),
        (lambda tmp: torch.frombuffer(_file_mapping(tmp, mmap.MAP_PRIVATE), dtype=torch.uint8), "private mapping of"),
    ],
)
def test_memory_that_is_not_the_tensors_own_anonymous_or_shmem_pages_stays_put(make, reason, tmp_path):
    tensor = make(tmp_path) if make.__code__.co_argcount else make()
    before = tensor.clone()
    with pytest.raises(NotRemappable, match=reason):
        remap(tensor)
    assert torch.equal(tensor, before) and segment_of(tensor) is None


def test_hugetlb_and_unmapped_ranges_are_refused(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000200000 rw-s 00000000 00:0f 42   /anon_hugepage (deleted)\n"
        "Size:               2048 kB\nKernelPageSize:     2048 kB\n"
        "7f0000400000-7f0000401000 rw-p 00000000 00:00 0 \nKernelPageSize:        4 kB\n"
    )
    with pytest.raises(NotRemappable, match="hugetlb"):
        check_own_pages(0x7F0000000000, 0x200000, str(smaps))
    assert [v.page_kib for v in check_own_pages(0x7F0000400000, PAGE, str(smaps))] == [4]
    with pytest.raises(NotRemappable, match="not all mapped"):
        check_own_pages(0x7F0000400000, 2 * PAGE, str(smaps))


def _file_mapping(tmp_path, flags):
    path = tmp_path / "file"
    path.write_bytes(b"\0" * PAGE)
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), PAGE, flags)
