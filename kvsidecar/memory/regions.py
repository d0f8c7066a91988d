"""A session's registered memory: strided regions over its mappings, and every address a transfer uses.

Nothing else in the daemon computes an address. A block id becomes an address only here, after a bounds check
against the region it falls in, and a mapping is unmapped only when no store call is using it.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvsidecar.errors import BadRequest
from kvsidecar.memory.mappings import Mapping
from kvsidecar.memory.slices import SliceTemplate
from kvsidecar.values import Handle, RegionRequest
from kvsidecar_contract.limits import MAX_REGIONS
from kvsidecar_contract.placement import StateCut

__all__ = ["Cut", "MappingOpener", "Region", "SessionMemory"]

# How a group's block becomes its stored values: (values, heads), that many equal head-major parts of every region
# (rule 11; (1, 1): the whole block), or a StateCut: layers of recurrent state cut into the rank's pieces (rule 12).
Cut = tuple[int, int] | StateCut


class MappingOpener(Protocol):
    """What opens a registration's mappings (mappings.Opener; tests pass their own)."""

    def key(self, i: int, handle: Handle | None) -> str:
        """What identifies region i's mapping; raises if the session may not use the handle."""
        ...

    def open(self, handle: Handle | None, size: int) -> Mapping:
        """Map size bytes of the handle's memory."""
        ...


@dataclass(frozen=True, slots=True)
class Region:
    """One strided view of a mapping: block b is [offset + b * stride, + block_bytes)."""

    mapping: Mapping
    offset: int
    stride: int
    block_bytes: int
    num_blocks: int
    groups: tuple[int, ...]

    def address(self, block_id: int) -> int:
        """The address of block_id's slice; the caller has checked block_id < num_blocks."""
        return self.mapping.address + self.offset + block_id * self.stride


class SessionMemory:
    """All regions of one session, grouped per KV-cache group in registration order."""

    def __init__(
        self,
        regions: Sequence[RegionRequest],
        num_groups: int,
        opener: MappingOpener,
        cuts: Sequence[Cut] = (),
    ) -> None:
        """Check every region, then map each distinct piece of memory once; all or nothing.

        cuts[g] = (values, heads): values > 1 cuts every block of group g into that many values, each of the same
        number of the rank's `heads` KV heads (docs/placement.md rule 11): every region of the group must then
        declare that its block is those `heads` head-major parts. cuts[g] a StateCut: the group's block, its regions
        in order, is one layer's recurrent state after another, and each value is one of the rank's state pieces:
        byte ranges of every layer (rule 12).

        `device` says which GPU holds the memory (None: host memory); `templates`, where every value's slices lie,
        are what a mover that copies whole batches plans with (kvsidecar/movers).
        """
        cuts = list(cuts) or [(1, 1)] * num_groups
        parts = [1 if isinstance(c, StateCut) else c[0] for c in cuts]
        heads = [1 if isinstance(c, StateCut) else c[1] for c in cuts]
        if not regions:
            raise BadRequest("RegisterMemory needs at least one region")
        if len(regions) > MAX_REGIONS:
            raise BadRequest(f"at most {MAX_REGIONS} regions per session, got {len(regions)}")
        for i, r in enumerate(regions):
            _check_region(i, r, num_groups)
            _check_heads(i, r, parts, heads)
        covered = {g for r in regions for g in r.groups}
        missing = sorted(set(range(num_groups)) - covered)
        if missing:
            raise BadRequest(f"groups {missing} have no region: every group needs at least one")
        keys = [opener.key(i, r.handle) for i, r in enumerate(regions)]
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False
        # Views of one segment share its mapping, opened once at the largest size any of them needs.
        sizes: dict[str, int] = {}
        handles: dict[str, Handle | None] = {}
        for key, r in zip(keys, regions, strict=True):
            sizes[key] = max(sizes.get(key, 0), r.mapping_bytes)
            handles.setdefault(key, r.handle)
        self.mappings: dict[str, Mapping] = {}
        try:
            for key, size in sizes.items():
                self.mappings[key] = opener.open(handles[key], size)
        except BaseException:
            for m in self.mappings.values():
                m.close()
            raise
        self.groups: list[list[Region]] = [[] for _ in range(num_groups)]
        for key, r in zip(keys, regions, strict=True):
            region = Region(self.mappings[key], r.offset, r.stride, r.block_bytes, r.num_blocks, r.groups)
            for g in r.groups:
                self.groups[g].append(region)
        # Per group and value, computed once: a save or load asks for one address per slice for every value it
        # moves (61 regions x hundreds of blocks for an MLA model, more slices per state piece), so this is the
        # data path's innermost loop: an address is a base plus block_id times a stride, nothing else.
        pieces = [
            _state_pieces(g, regions, cut) if isinstance(cut, StateCut) else _head_pieces(regions, cut[0])
            for g, (regions, cut) in enumerate(zip(self.groups, cuts, strict=True))
        ]
        merged = [[_merged(piece) for piece in group] for group in pieces]
        self._tables = [
            [_Table.of(regions, piece) for piece in group] for regions, group in zip(self.groups, merged, strict=True)
        ]
        # What a value is at every TP size (its slice sizes, before adjacent slices are merged): the shape the
        # daemon checks a namespace's values against (sessions/shapes.py).
        self.value_shapes = [[tuple(size for _, _, size in piece) for piece in group] for group in pieces]
        # Bytes of each stored value of a block: every region's block, one head group's part of each, or a piece.
        self.part_bytes = [[sum(shape) for shape in shapes] for shapes in self.value_shapes]
        self.value_bytes = [sizes[0] for sizes in self.part_bytes]  # a block's first value, for the client
        self.mapped_bytes = sum(m.size for m in self.mappings.values())
        # Host memory (memfds, /dev/shm), the part the daemon could be made to fault in: what the caps count.
        self.host_bytes = sum(m.size for m in self.mappings.values() if m.identity[0] in ("memfd", "shm"))
        self._blocks_in_group = [min(r.num_blocks for r in regions) for regions in self.groups]
        key_of = {id(m): key for key, m in self.mappings.items()}
        # Where each value's slices lie, per group and part: the addresses above, as templates for copy plans.
        self.templates = [
            [
                [
                    SliceTemplate(key_of[id(rs[i].mapping)], rs[i].offset + offset, rs[i].stride, size)
                    for i, offset, size in piece
                ]
                for piece in group
            ]
            for rs, group in zip(self.groups, merged, strict=True)
        ]
        self.device = _device_of(list(self.mappings.values()))

    def buffers(self, group: int, block_id: int, part: int = 0) -> tuple[list[int], list[int]]:
        """Addresses and sizes of one stored value: its slices of the group's regions, in the value's order.

        part selects one value where the group stores several per block: a head group's part of each region
        (rule 11), or a state piece (rule 12).
        """
        if not 0 <= block_id < self._blocks_in_group[group]:
            self._out_of_bounds(group, block_id)
        tables = self._tables[group]
        if not 0 <= part < len(tables):
            raise BadRequest(f"group {group}: value part {part} of a block cut in {len(tables)}")
        table = tables[part]
        if table.stride is not None:
            offset = block_id * table.stride
            return [base + offset for base in table.bases], list(table.sizes)
        return [base + block_id * s for base, s in zip(table.bases, table.strides, strict=True)], list(table.sizes)

    def check(self, group: int, block_id: int, part: int = 0) -> None:
        """Raise BadRequest unless block_id (and part) names a block every region of the group holds."""
        if not 0 <= block_id < self._blocks_in_group[group]:
            self._out_of_bounds(group, block_id)
        if not 0 <= part < len(self._tables[group]):
            raise BadRequest(f"group {group}: value part {part} of a block cut in {len(self._tables[group])}")

    def _out_of_bounds(self, group: int, block_id: int) -> None:
        for i, region in enumerate(self.groups[group]):
            if not 0 <= block_id < region.num_blocks:
                raise BadRequest(
                    f"group {group}: block id {block_id} is outside region {i} of the group "
                    f"({region.num_blocks} blocks)"
                )

    def acquire(self) -> None:
        """Hold the mappings for a store call; raises once the session is closing or its memory became unsafe."""
        with self._lock:
            if self._closed:
                raise BadRequest("the session's memory is being released")
            for m in self.mappings.values():
                m.check()
            self._in_flight += 1

    def release(self) -> None:
        """End a store call started with acquire()."""
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()

    def close(self, idle: Callable[[], None] = lambda: None) -> None:
        """Once no store call uses the memory, run `idle` (its mover lets go of it), then unmap everything; later
        acquire() calls fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Unmapping under a running transfer would crash the daemon: wait for them (they are bounded).
            self._lock.wait_for(lambda: self._in_flight == 0)
        try:
            idle()
        finally:
            for m in self.mappings.values():
                m.close()


def _device_of(mappings: Sequence[Mapping]) -> str | None:
    """ "cuda:N" when every mapping is CUDA memory of the daemon's device N; None for host memory.

    A session's memory is on one device or none: its values are gathered and scattered on that device."""
    devices = {m.device for m in mappings}
    if len(devices) > 1:
        raise BadRequest(
            f"a session's regions must all be host memory or all on one GPU, got {', '.join(sorted(devices))}"
        )
    (device,) = devices
    return None if device == "cpu" else device


def _common(values: Sequence[int]) -> int | None:
    """The one value all of values share, else None."""
    first = values[0] if values else None
    return first if all(v == first for v in values) else None


Piece = list[tuple[int, int, int]]  # one value: (region index in its group, offset in the region's block, size)


class _Table(NamedTuple):
    """One value's slices as addresses of block 0 and strides: block b's slice i is bases[i] + b * strides[i]."""

    bases: list[int]
    strides: list[int]
    stride: int | None  # the one stride all slices share, if they do
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, regions: Sequence[Region], piece: Piece) -> _Table:
        """The table of one value."""
        bases = [regions[i].mapping.address + regions[i].offset + offset for i, offset, _ in piece]
        strides = [regions[i].stride for i, _, _ in piece]
        return cls(bases, strides, _common(strides), tuple(size for _, _, size in piece))


def _merged(piece: Piece) -> Piece:
    """A value's slices with adjacent ones of one region joined (its bytes stay in order): fewer for the store."""
    out: Piece = []
    for i, offset, size in piece:
        if out and out[-1][0] == i and out[-1][1] + out[-1][2] == offset:
            out[-1] = (i, out[-1][1], out[-1][2] + size)
        else:
            out.append((i, offset, size))
    return out


def _head_pieces(regions: Sequence[Region], values: int) -> list[Piece]:
    """Rule 11: value p is the p-th of `values` equal parts of every region's block (one value: the whole block)."""
    return [
        [(i, p * (r.block_bytes // values), r.block_bytes // values) for i, r in enumerate(regions)]
        for p in range(values)
    ]


def _state_pieces(group: int, regions: Sequence[Region], cut: StateCut) -> list[Piece]:
    """Rule 12: each piece's byte ranges in every layer, where the group's regions hold layer after layer.

    The regions' blocks, in order, must be whole layers of cut.layer_bytes, each region starting where one of the
    state's tensors starts (a region per layer, or per state tensor): anything else is not this state's layout.
    """
    layer = cut.layer_bytes
    starts = list(itertools.accumulate((r.block_bytes for r in regions), initial=0))
    total = starts[-1]
    if total % layer:
        raise BadRequest(
            f"group {group} stores its recurrent state in pieces any TP size reads (rule 12): its regions must hold "
            f"whole layers of {layer} bytes (this rank's state as the session describes it), they hold {total} bytes "
            "per block (padding, or a state laid out otherwise?)"
        )
    tensors = set(cut.tensor_starts)
    for i, start in enumerate(starts[:-1]):
        if start % layer not in tensors:
            raise BadRequest(
                f"group {group}: region {i} starts at byte {start % layer} of a layer's recurrent state, where no "
                f"state tensor starts (tensors start at {sorted(tensors)}): a region must hold whole tensors"
            )
    out: list[Piece] = []
    for slices in cut.pieces:
        piece: Piece = []
        for base in range(0, total, layer):
            for offset, size in slices:
                i = bisect.bisect_right(starts, base + offset) - 1
                piece.append((i, base + offset - starts[i], size))
        out.append(piece)
    return out


def _check_heads(i: int, spec: RegionRequest, parts: Sequence[int], heads: Sequence[int]) -> None:
    """A region of a group cut by KV heads must say its block is the rank's heads, head-major, in equal parts."""
    for g in spec.groups:
        if not 0 <= g < len(parts) or parts[g] == 1:
            continue
        n, h = parts[g], heads[g]
        if spec.heads != h:
            said = f"declares {spec.heads} heads" if spec.heads else "declares no heads"
            raise BadRequest(
                f"region {i}: group {g} stores {n} values per block across TP sizes, each of {h // n} of this rank's "
                f"{h} KV heads, so each block of its regions must be {h} head-major parts (MemoryRegion.heads = {h}); "
                f"this region {said} (a layout whose heads are not the outermost dimension of a block cannot share "
                "values across TP sizes)"
            )
        if spec.block_bytes % h:
            raise BadRequest(f"region {i}: block_bytes {spec.block_bytes} is not {h} equal head parts")


def _check_region(i: int, spec: RegionRequest, num_groups: int) -> None:
    where = f"region {i}"
    if spec.num_blocks < 1:
        raise BadRequest(f"{where}: num_blocks must be >= 1")
    if spec.block_bytes < 1:
        raise BadRequest(f"{where}: block_bytes must be >= 1")
    if spec.num_blocks > 1 and spec.stride < spec.block_bytes:
        raise BadRequest(f"{where}: block_stride {spec.stride} is smaller than block_bytes {spec.block_bytes}")
    end = spec.offset + (spec.num_blocks - 1) * spec.stride + spec.block_bytes
    if end > spec.mapping_bytes:
        raise BadRequest(f"{where}: its last block ends at byte {end}, past the mapping's {spec.mapping_bytes} bytes")
    if not spec.groups:
        raise BadRequest(f"{where}: names no group")
    bad = [g for g in spec.groups if not 0 <= g < num_groups]
    if bad:
        raise BadRequest(f"{where}: group index {bad[0]} out of range (session has {num_groups} groups)")
    if len(set(spec.groups)) != len(spec.groups):
        raise BadRequest(f"{where}: lists a group twice")
