"""Saves and loads of a session's device memory through its device's staging area, in rounds that fit it.

- put: per round, every value gathered into staging with one kernel per run of slices (memory/views.py), the stream
  synchronized, then one batch put of the staged values (Mooncake's CUDA build copies each to its replica);
- get: each value's replica in this node's segment is copied host-to-device into staging, adjacent replicas in one
  copy (values are placed in staging in the order they lie in the segment, per group), then scattered into the blocks
  with one kernel per run; values elsewhere (another node, the disk tier) are read by the store into the pinned
  bounce and copied up from there. A load returns once its bytes are in the engine's memory.

Failures stay per value, as on the host path: a value that was not read is never scattered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvsidecar.errors import StoreError
from kvsidecar.gpu.runtime import HostSegment
from kvsidecar.gpu.staging import ALIGN, StagingArea
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.store import Store, StoreCode
from kvsidecar.store.base import Replica
from kvsidecar_contract.placement import Chunk

__all__ = ["get", "put", "rounds"]

Failed = Callable[[str, StoreError], None]  # (operation, error): a store call that failed whole, for the metrics


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def rounds(sizes: Sequence[int], capacity: int) -> Iterator[list[int]]:
    """Consecutive runs of indices whose values fit in capacity bytes together, each value ALIGN-aligned.

    Raises ValueError for a value larger than capacity on its own (registration refuses such a layout)."""
    batch: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        need = _round_up(size)
        if need > capacity:
            raise ValueError(f"a value of {size} bytes does not fit a staging area of {capacity}")
        if used + need > capacity:
            yield batch
            batch, used = [], 0
        batch.append(i)
        used += need
    if batch:
        yield batch


def _buckets(chunks: Sequence[Chunk], members: Sequence[int]) -> list[tuple[tuple[int, int], list[int]]]:
    """members grouped by (group, part), in order of first appearance (each bucket is one gather or scatter)."""
    out: dict[tuple[int, int], list[int]] = {}
    for m in members:
        out.setdefault((chunks[m].group, chunks[m].part), []).append(m)
    return list(out.items())


def _typed(area: StagingArea, offset: int, n: int, memory: SessionMemory, group: int, part: int) -> Any:
    """n values of (group, part) at offset in staging, as the plan's [n, elements] view."""
    views = memory.views(group, part)
    size = memory.part_bytes[group][part]
    return area.staging[offset : offset + n * size].view(views.dtype).view(n, size // views.element)


def put(
    store: Store,
    area: StagingArea,
    memory: SessionMemory,
    keys: Sequence[str],
    chunks: Sequence[Chunk],
    failed: Failed,
) -> list[StoreCode]:
    """Write each chunk's value under its key from the engine's device memory; one code per chunk."""
    codes: list[StoreCode] = []
    sizes = [memory.part_bytes[c.group][c.part] for c in chunks]
    for batch in rounds(sizes, area.staging_bytes):
        places: dict[int, int] = {}
        with area.held():
            at = 0
            for (group, part), members in _buckets(chunks, batch):
                n = len(members)
                memory.views(group, part).gather(
                    area.index([chunks[m].block_id for m in members]), _typed(area, at, n, memory, group, part)
                )
                for i, m in enumerate(members):
                    places[m] = at + i * sizes[m]
                at = _round_up(at + n * sizes[members[0]])
            area.synchronize()  # the store's copies read staging on threads of their own
            base = int(area.staging.data_ptr())
            try:
                codes += store.put_from(
                    [keys[m] for m in batch],
                    [[base + places[m]] for m in batch],
                    [[sizes[m]] for m in batch],
                    device=True,
                )
            except StoreError as exc:
                failed("put", exc)
                codes += [exc.code] * len(batch)
    return codes


def get(
    store: Store,
    area: StagingArea,
    memory: SessionMemory,
    keys: Sequence[str],
    chunks: Sequence[Chunk],
    segment: HostSegment | None,
    failed: Failed,
) -> list[StoreCode]:
    """Read each chunk's value into its block of the engine's device memory; one code per chunk."""
    sizes = [memory.part_bytes[c.group][c.part] for c in chunks]
    codes = [StoreCode.OK] * len(chunks)
    located: list[Replica | None] = [None] * len(chunks)
    if segment is not None:
        try:
            located = store.locate(keys)
        except StoreError as exc:
            failed("locate", exc)  # the store reads them all instead
    local = []
    elsewhere = []
    for j, replica in enumerate(located):
        if replica is None:
            elsewhere.append(j)
        elif replica.size != sizes[j]:
            codes[j] = StoreCode.SIZE_MISMATCH
        else:
            local.append(j)
    if local and segment is not None:
        _copy_local(area, memory, chunks, sizes, located, local, segment)
    if elsewhere:
        _read_elsewhere(store, area, memory, keys, chunks, sizes, elsewhere, codes, failed)
    area.synchronize()  # the bytes are in the engine's memory (and off the replicas, whose lease is the store's)
    return codes


def _copy_local(
    area: StagingArea,
    memory: SessionMemory,
    chunks: Sequence[Chunk],
    sizes: Sequence[int],
    located: Sequence[Replica | None],
    local: list[int],
    segment: HostSegment,
) -> None:
    """Copy replicas in this node's segment up, adjacent ones at once, and scatter them."""
    start = segment.replica.address

    def where(j: int) -> int:
        replica = located[j]
        assert replica is not None
        return replica.address

    # Per bucket in the segment's order, so that replicas written by one batch put become one copy.
    order = [m for _, members in _buckets(chunks, local) for m in sorted(members, key=where)]
    for batch in rounds([sizes[j] for j in order], area.staging_bytes):
        members_of = [order[i] for i in batch]
        with area.held():
            at = 0
            copies: list[list[int]] = []  # [source offset, staging offset, length], merged when adjacent
            scatters = []
            for (group, part), members in _buckets(chunks, members_of):
                first = at
                for j in members:
                    src = where(j) - start
                    if copies and copies[-1][0] + copies[-1][2] == src and copies[-1][1] + copies[-1][2] == at:
                        copies[-1][2] += sizes[j]
                    else:
                        copies.append([src, at, sizes[j]])
                    at += sizes[j]
                scatters.append((group, part, members, first))
                at = _round_up(at)
            for src, dst, length in copies:
                area.staging[dst : dst + length].copy_(segment.tensor[src : src + length], non_blocking=True)
            for group, part, members, first in scatters:
                memory.views(group, part).scatter(
                    area.index([chunks[j].block_id for j in members]),
                    _typed(area, first, len(members), memory, group, part),
                )
            # No wait here: the next round's copies queue behind these scatters on the area's stream.


def _read_elsewhere(
    store: Store,
    area: StagingArea,
    memory: SessionMemory,
    keys: Sequence[str],
    chunks: Sequence[Chunk],
    sizes: Sequence[int],
    elsewhere: list[int],
    codes: list[StoreCode],
    failed: Failed,
) -> None:
    """Have the store read values it holds elsewhere into the pinned bounce, copy the good ones up and scatter."""
    capacity = min(area.bounce_bytes, area.staging_bytes)
    for batch in rounds([sizes[j] for j in elsewhere], capacity):
        members_of = [elsewhere[i] for i in batch]
        with area.held():
            base = int(area.bounce.data_ptr())
            places: dict[int, int] = {}
            at = 0
            for j in members_of:
                places[j] = at
                at = _round_up(at + sizes[j])
            try:
                got = store.get_into(
                    [keys[j] for j in members_of],
                    [[base + places[j]] for j in members_of],
                    [[sizes[j]] for j in members_of],
                )
            except StoreError as exc:
                failed("get", exc)
                got = [exc.code] * len(members_of)
            good = []
            for j, code in zip(members_of, got, strict=True):
                codes[j] = code
                if code is StoreCode.OK:
                    good.append(j)
            at = 0
            for (group, part), members in _buckets(chunks, good):
                first = at
                for j in members:
                    bounced = area.bounce[places[j] : places[j] + sizes[j]]
                    area.staging[at : at + sizes[j]].copy_(bounced, non_blocking=True)
                    at += sizes[j]
                memory.views(group, part).scatter(
                    area.index([chunks[j].block_id for j in members]),
                    _typed(area, first, len(members), memory, group, part),
                )
                at = _round_up(at)
            area.synchronize()  # the bounce is read by the copies above before the next round reuses it
