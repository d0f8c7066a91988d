"""SessionMemory.buffers, the data path's innermost loop, against Region.address for every block of mixed regions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.values import RegionRequest
from kvsidecar_contract.placement import StateCut


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


# Rule 12: one layer's state of 40 bytes, tensors at 0 and 24; piece 0 is three ranges, piece 1 two adjacent ones.
CUT = StateCut(40, (0, 24), (((0, 4), (12, 4), (24, 8)), ((4, 4), (8, 4))))


def test_state_pieces_are_every_layers_ranges_with_adjacent_ones_merged():
    # Two layers: one region per layer's page (stride 48: 8 bytes of padding), and one layer as two tensor regions.
    specs = [
        spec("a", 1 << 32, 0, 48, 40, 4, (0,)),
        spec("b", 2 << 32, 0, 24, 24, 4, (0,)),
        spec("c", 3 << 32, 0, 64, 16, 4, (0,)),
    ]
    memory = SessionMemory(specs, 1, FakeOpener(), [CUT])
    a, b, c = (1 << 32, 2 << 32, 3 << 32)
    for block in range(4):
        assert memory.buffers(0, block, 0) == (
            [a + 48 * block, a + 48 * block + 12, a + 48 * block + 24, b + 24 * block, b + 24 * block + 12,
             c + 64 * block],
            [4, 4, 8, 4, 4, 8],
        )  # fmt: skip
        assert memory.buffers(0, block, 1) == ([a + 48 * block + 4, b + 24 * block + 4], [8, 8])
    assert memory.value_shapes == [[(4, 4, 8, 4, 4, 8), (4, 4, 4, 4)]]  # before merging: the same at every TP size
    assert memory.part_bytes == [[32, 16]]
    with pytest.raises(BadRequest, match="value part 2 of a block cut in 2"):
        memory.buffers(0, 0, 2)


@pytest.mark.parametrize(
    ("blocks", "reason"),
    [
        ((40, 20), "must hold whole layers of 40 bytes .* they hold 60 bytes per block"),
        ((20, 20), "region 1 starts at byte 20 of a layer's recurrent state, where no state tensor starts"),
    ],
)
def test_regions_that_are_not_whole_layers_of_the_state_are_refused(blocks, reason):
    specs = [spec(str(i), (i + 1) << 32, 0, 64, n, 4, (0,)) for i, n in enumerate(blocks)]
    with pytest.raises(BadRequest, match=reason):
        SessionMemory(specs, 1, FakeOpener(), [CUT])
