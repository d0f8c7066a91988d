"""Engine memory: names, bounds, addresses and the release of mappings."""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import replace
from multiprocessing import shared_memory

import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.memory.mappings import Opener, ShmMapping
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.values import RegionRequest, ShmHandle


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=8192)
    shm.buf[:] = bytes(8192)  # backed by its owner, as the client's segments are (the daemon backs none)
    yield shm
    shm.close()
    shm.unlink()


SHM = Opener(shm_names=True)  # these tests are a trusted rank's


def spec(shm, *, offset=0, stride=1024, block=1024, blocks=8, groups=(0,), size=8192) -> RegionRequest:
    return RegionRequest(ShmHandle(shm.name), size, offset, stride, block, blocks, groups)


def test_views_of_one_segment_share_one_mapping_and_compute_addresses(segment):
    # vLLM's (2, num_blocks, ...) layout: K blocks first, then V blocks, of one segment.
    memory = SessionMemory([spec(segment, blocks=4), spec(segment, offset=4096, blocks=4)], 1, SHM)
    try:
        assert len(memory.mappings) == 1
        assert memory.value_bytes == [2048]
        addresses, sizes = memory.buffers(0, 3)
        base = next(iter(memory.mappings.values())).address
        assert addresses == [base + 3072, base + 4096 + 3072] and sizes == [1024, 1024]
        segment.buf[4096 + 3072] = 0x5A
        assert ctypes.c_ubyte.from_address(addresses[1]).value == 0x5A
    finally:
        memory.close()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"blocks": 9}, "past the mapping's 8192 bytes"),
        ({"offset": 1, "blocks": 8}, "past the mapping"),
        ({"stride": 512}, "block_stride 512 is smaller than block_bytes 1024"),
        ({"groups": (2,)}, "group index 2 out of range"),
        ({"groups": ()}, "names no group"),
        ({"groups": (0, 0)}, "lists a group twice"),
        ({"blocks": 0}, "num_blocks must be >= 1"),
        ({"size": 1 << 20, "blocks": 1024}, "has 8192 bytes, region claims 1048576"),
    ],
)
def test_bad_regions(segment, kwargs, reason):
    with pytest.raises(BadRequest, match=reason):
        SessionMemory([spec(segment, **kwargs)], 1, SHM)


def test_every_group_needs_a_region(segment):
    with pytest.raises(BadRequest, match=r"groups \[1\] have no region"):
        SessionMemory([spec(segment)], 2, SHM)


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "..", "", "x" * 300])
def test_segment_names_cannot_escape_dev_shm(name):
    with pytest.raises(BadRequest):
        ShmMapping(name, 4096)


def test_missing_segment():
    with pytest.raises(BadRequest, match="cannot open shared memory"):
        ShmMapping("kvsidecar-does-not-exist", 4096)


def test_a_sparse_segment_is_refused_and_a_punched_one_refused_from_then_on(segment):
    sparse = shared_memory.SharedMemory(create=True, size=8192)  # only truncated: one hole
    try:
        with pytest.raises(BadRequest, match=r"is not fully backed: 0 of its 8192 bytes .*posix_fallocate"):
            ShmMapping(sparse.name, 8192)
        assert os.stat(f"/dev/shm/{sparse.name}").st_blocks == 0  # the daemon allocated none of it
    finally:
        sparse.close()
        sparse.unlink()
    mapping = ShmMapping(segment.name, 8192)
    try:
        mapping.check()
        fd = os.open(f"/dev/shm/{segment.name}", os.O_RDWR)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
            assert libc.fallocate(fd, 0x03, 0, 4096) == 0  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        finally:
            os.close(fd)
        with pytest.raises(BadRequest, match=r"lost pages after registration \(4096 of 8192 bytes backed"):
            mapping.check()
    finally:
        mapping.close()


def test_block_ids_outside_a_region(segment):
    memory = SessionMemory([spec(segment, blocks=8), spec(segment, blocks=2, groups=(0,))], 1, SHM)
    try:
        with pytest.raises(BadRequest, match="block id 2 is outside region 1 of the group"):
            memory.buffers(0, 2)
        with pytest.raises(BadRequest, match="block id -1"):
            memory.buffers(0, -1)
    finally:
        memory.close()


def test_close_waits_for_store_calls_in_flight(segment):
    memory = SessionMemory([spec(segment)], 1, SHM)
    memory.acquire()
    closed = threading.Event()
    t = threading.Thread(target=lambda: (memory.close(), closed.set()))
    t.start()
    assert not closed.wait(0.3)  # still in flight: the mapping must stay
    memory.release()
    assert closed.wait(5)
    t.join()
    with pytest.raises(BadRequest, match="being released"):
        memory.acquire()


def test_a_group_cut_per_kv_head_gives_each_head_its_part_of_every_region(segment):
    # Rule 11: a block of 4 KV heads (head-major: 256 bytes each) in K and V; value 2 is head 2 of both.
    regions = [spec(segment, blocks=4), spec(segment, offset=4096, blocks=4)]
    memory = SessionMemory([replace(r, heads=4) for r in regions], 1, SHM, [(4, 4)])
    try:
        base = next(iter(memory.mappings.values())).address
        assert memory.value_bytes == [512]
        assert memory.buffers(0, 3, 2) == ([base + 3072 + 512, base + 4096 + 3072 + 512], [256, 256])
        assert memory.buffers(0, 3, 0) == ([base + 3072, base + 4096 + 3072], [256, 256])
        with pytest.raises(BadRequest, match="value part 4 of a block cut in 4"):
            memory.buffers(0, 3, 4)
    finally:
        memory.close()


@pytest.mark.parametrize(
    ("heads", "block", "reason"),
    [
        (0, 1024, r"must be 8 head-major parts \(MemoryRegion.heads = 8\); this region declares no heads"),
        (2, 1024, "stores 4 values per block across TP sizes, each of 2 of this rank's 8 KV heads"),
        (8, 1020, "block_bytes 1020 is not 8 equal head parts"),
    ],
)
def test_a_region_of_a_group_cut_per_head_must_declare_its_heads(segment, heads, block, reason):
    with pytest.raises(BadRequest, match=reason):
        SessionMemory([replace(spec(segment, block=block), heads=heads)], 1, SHM, [(4, 8)])
