"""SessionMemory.buffers, the data path's innermost loop, against Region.address for every block of mixed regions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.values import RegionRequest


@dataclass
class FakeMapping:
    address: int
    size: int
    identity: tuple[object, ...] = ("fake",)
    device: str = "cpu"

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeOpener:
    """Maps a region's handle (here: a (key, base address) pair) to a fake mapping at that address."""

    def key(self, i: int, handle: object) -> str:
        return handle[0]  # type: ignore[index,no-any-return]

    def open(self, handle: object, size: int) -> FakeMapping:
        key, base = handle  # type: ignore[misc]
        return FakeMapping(base, size, (key,))


def spec(
    key: str, base: int, offset: int, stride: int, block: int, blocks: int, groups: tuple[int, ...]
) -> RegionRequest:
    size = offset + (blocks - 1) * stride + block
    return RegionRequest((key, base), size, offset, stride, block, blocks, groups)  # type: ignore[arg-type]


@pytest.mark.parametrize("same_stride", [True, False])
def test_buffers_match_region_addresses(same_stride):
    specs = [
        spec("a", 1 << 32, 0, 4096, 4096, 10, (0, 1)),
        spec("b", 2 << 32, 128, 4096 if same_stride else 8192, 1024, 12, (0,)),
        spec("c", 3 << 32, 64, 512, 512, 8, (1,)),
    ]
    memory = SessionMemory(specs, 2, FakeOpener())
    for group, regions in enumerate(memory.groups):
        limit = min(r.num_blocks for r in regions)
        for block in range(limit):
            assert memory.buffers(group, block) == (
                [r.address(block) for r in regions],
                [r.block_bytes for r in regions],
            )
        with pytest.raises(BadRequest, match=f"block id {limit} is outside region"):
            memory.buffers(group, limit)
        with pytest.raises(BadRequest, match="block id -1 is outside region 0"):
            memory.buffers(group, -1)
    # Callers get lists of their own.
    _, sizes = memory.buffers(0, 1)
    sizes.append(7)
    assert memory.buffers(0, 1)[1] == [4096, 1024]
    assert memory.value_bytes == [5120, 4608]
