"""The device mover's copy plans: runs of slice templates, and gather/scatter through views against the byte oracle
of SessionMemory.buffers (every slice's address), on CPU tensors standing in for a GPU's."""

from __future__ import annotations

import ctypes
from multiprocessing import shared_memory

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.memory.mappings import Opener
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.memory.slices import SliceTemplate
from kvsidecar.movers.plans import Run, ValueViews, element_bytes, runs
from kvsidecar.values import RegionRequest, ShmHandle

SEGMENT = 1 << 16


def t(mapping: str, offset: int, stride: int = 4096, length: int = 256) -> SliceTemplate:
    return SliceTemplate(mapping, offset, stride, length)


@pytest.mark.parametrize(
    ("templates", "expected"),
    [
        # vLLM 0.33: every layer a view of one buffer, layer-major: one run, whatever the number of layers.
        ([t("a", 0), t("a", 1 << 20), t("a", 2 << 20), t("a", 3 << 20)], [Run(0, 4, 1 << 20)]),
        # One tensor per layer (separate allocations): one run each.
        ([t("a", 0), t("b", 0), t("c", 0)], [Run(0, 1, 0), Run(1, 1, 0), Run(2, 1, 0)]),
        # K then V of each layer in one buffer: (K0, V0, K1, V1) evenly spaced is still one run.
        ([t("a", 0), t("a", 512), t("a", 1024), t("a", 1536)], [Run(0, 4, 512)]),
        # The step changes: a new run starts where it does.
        ([t("a", 0), t("a", 512), t("a", 2048), t("a", 3584)], [Run(0, 2, 512), Run(2, 2, 1536)]),
        # Overlapping or repeated slices are not a layout of distinct slices: never one view.
        ([t("a", 0), t("a", 100)], [Run(0, 1, 0), Run(1, 1, 0)]),
        ([t("a", 0), t("a", 0)], [Run(0, 1, 0), Run(1, 1, 0)]),
        # Another stride or length breaks a run.
        ([t("a", 0), t("a", 512, stride=8192)], [Run(0, 1, 0), Run(1, 1, 0)]),
        ([t("a", 0), t("a", 512, length=128)], [Run(0, 1, 0), Run(1, 1, 0)]),
        ([], []),
    ],
)
def test_runs(templates, expected):
    assert runs(templates) == expected


def test_element_bytes_is_the_widest_that_divides_everything():
    assert element_bytes(4096, 1 << 20, 256) == 8
    assert element_bytes(4096, 12) == 4
    assert element_bytes(4096, 6) == 2
    assert element_bytes(4096, 3) == 1


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=SEGMENT)
    shm.buf[:] = bytes(range(256)) * (SEGMENT // 256)  # backed, and every byte telling where it is
    yield shm
    shm.close()
    shm.unlink()


def plan(memory: SessionMemory, group: int = 0, part: int = 0) -> ValueViews:
    """The copy plan of one (group, part), over the memory's mappings as CPU tensors."""
    tensors = {key: m.tensor() for key, m in memory.mappings.items()}
    return ValueViews(memory.templates[group][part], tensors)


def _value(memory: SessionMemory, group: int, block: int, part: int) -> bytes:
    """The byte oracle: a value is its slices at the addresses the host path uses, concatenated."""
    addresses, sizes = memory.buffers(group, block, part)
    return b"".join(ctypes.string_at(a, n) for a, n in zip(addresses, sizes, strict=True))


# A region: (offset, stride, block bytes); every layout below fits 8 blocks in the segment.
layouts = st.sampled_from(
    [
        [(0, 1024, 1024)],  # one region
        [(i * 8192, 1024, 1024) for i in range(4)],  # vLLM: layers of one buffer, one run
        [(0, 2048, 1024), (1024, 2048, 1024)],  # K and V interleaved per block
        [(0, 1024, 512), (8192, 1024, 1024), (24576, 2048, 2048)],  # nothing in common: one run each
        [(i * 8192 + 8, 1024, 1000) for i in range(3)],  # odd sizes: byte elements
        [(0, 4096, 4096), (40960, 1024, 1024), (49152, 1024, 1024)],  # two runs of different shapes
    ]
)


# The segment carries over between examples on purpose: each example compares it before and after itself.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, data=st.data())
def test_gather_and_scatter_move_exactly_the_values_the_host_path_addresses(segment, layout, data):
    regions = [RegionRequest(ShmHandle(segment.name), SEGMENT, o, s, b, 8, (0,)) for o, s, b in layout]
    memory = SessionMemory(regions, 1, Opener(shm_names=True))
    try:
        views = plan(memory)
        blocks = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
        index = torch.tensor(blocks, dtype=torch.int64)
        size = memory.value_bytes[0]
        out = torch.empty(len(blocks) * size, dtype=torch.uint8)
        views.gather(index, out.view(views.dtype).view(len(blocks), -1))
        assert out.numpy().tobytes() == b"".join(_value(memory, 0, b, 0) for b in blocks)

        # Scatter new bytes into other blocks: exactly their slices change, nothing else in the segment.
        targets = data.draw(st.permutations(range(8)))[: len(blocks)]
        fresh = torch.randint(0, 256, (len(blocks) * size,), dtype=torch.uint8)
        before = bytes(segment.buf)
        views.scatter(torch.tensor(targets, dtype=torch.int64), fresh.view(views.dtype).view(len(blocks), -1))
        for j, b in enumerate(targets):
            assert _value(memory, 0, b, 0) == fresh[j * size : (j + 1) * size].numpy().tobytes()
        expected = bytearray(before)
        for j, b in enumerate(targets):
            addresses, sizes = memory.buffers(0, b)
            base = next(iter(memory.mappings.values())).address
            at = j * size
            for a, n in zip(addresses, sizes, strict=True):
                expected[a - base : a - base + n] = fresh[at : at + n].numpy().tobytes()
                at += n
        assert bytes(segment.buf) == bytes(expected)
    finally:
        memory.close()


def test_values_cut_per_head_gather_one_part_of_each_slice(segment):
    # Rule 11: a block of 4 KV heads, head-major, stored as 2 values of 2 heads each.
    regions = [RegionRequest(ShmHandle(segment.name), SEGMENT, i * 16384, 2048, 2048, 8, (0,), 4) for i in range(2)]
    memory = SessionMemory(regions, 1, Opener(shm_names=True), [(2, 4)])
    try:
        assert memory.value_bytes == [2048]
        for part in (0, 1):
            out = torch.empty(2 * 2048, dtype=torch.uint8)
            views = plan(memory, 0, part)
            views.gather(torch.tensor([5, 2]), out.view(views.dtype).view(2, -1))
            assert out.numpy().tobytes() == _value(memory, 0, 5, part) + _value(memory, 0, 2, part)
    finally:
        memory.close()
