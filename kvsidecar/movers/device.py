"""GPU memory's mover: a save gathered into a staging slot on the GPU and put from there; a load copied from this
node's page-locked segment into staging and scattered into the engine's blocks.

Save, per round of values that fit a slot:
  1. the values' block ids uploaded into the slot's index buffer, one gather kernel per run of slices (plans.py)
     per (group, part) into staging;
  2. the values whose keys are chosen for a checksum (trailer.py) copied down from staging into the slot's
     page-locked bounce, behind the gathers;
  3. the slot's stream synchronized: staging holds every value of the round, the bounce the chosen ones, which the
     CPU sums into their trailers (no kernel of ours, nothing on the engine's streams);
  4. one batch put from staging, one buffer per value and a chosen value's trailer (host memory) as a second
     (Mooncake's CUDA build copies each to its replica, one synchronous cudaMemcpy per device buffer on its single
     copy worker: the bound on saves, docs/benchmarks/gpu.md).
Load:
  1. the store says where each value's replica lies in this node's segment, read-leased as a get is; values take
     their places in staging in the order the request names them (the order a save's batch put laid them out), and
     replicas adjacent both there and in the segment are copied host-to-device at once, each copy queued as soon as
     it is known, so the store's per-value walk runs while earlier copies move;
  2. per round, one scatter kernel per run of slices, per (group, part) and evenly spaced run of its values in
     staging, from staging into the blocks; the next round's copies queue behind them;
  3. values not in the segment (another node, the disk tier) are read by the store into the slot's page-locked
     bounce, checked against their trailers there, and the ones read completely and intact are copied up and
     scattered the same way;
  4. the values copied from the segment are checked against their trailers by the CPU, from the segment, while the
     copies and scatters run: one that fails was scattered, and is reported failed (the engine recomputes its block
     before anything reads it).
A value with a trailer is copied with it (adjacent replicas stay one copy); the scatters read the bytes before it.

The ordering contract, as events on the slot's stream S (staging.py gives each slot its own):
- a request takes a slot with S idle, and gives it back only after synchronizing S, whatever its outcome (an error
  included): nothing it queued runs after it answered, so nothing touches memory a closing session unmaps (memory
  is unmapped only once no request holds it: memory/regions.py);
- a save's blocks hold the engine's bytes when its request arrives (the client waited for the engine's own stream:
  client/kvsidecar_client/vllm/worker.py); the gathers read them on S, and S is synchronized before the put, so the
  store reads complete values; the engine may reuse the blocks once the save answers;
- block ids are written into the slot's page-locked index buffer and uploaded on S without the host waiting; the
  kernel that reads them follows on S; an index entry is written again only after S was synchronized since;
- a load's copies into staging follow the previous round's scatters on S, so no staging byte is overwritten before
  it was scattered; the bounce is written again only after S was synchronized since its copies were queued;
- a load's bytes are in the engine's memory when it answers (S synchronized); the engine queues its next kernels
  on them after the answer; a value that was not read completely is never copied up, nor scattered;
- a save's copies down to the bounce follow its gathers on S, and S is synchronized before the CPU sums them; the
  next round's copies down are queued after those sums.

A CUDA error in any step: S is still synchronized before the slot goes back; a device left unusable by it (a sticky
error, movers/accelerators.py) fails the whole GPU path (runtime.py) and the request is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvsidecar.errors import BadRequest, DeviceUnavailable, StoreError
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.memory.slices import host_bytes
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import by_pin, check_chunks, count_failure
from kvsidecar.movers.plans import ValueViews
from kvsidecar.movers.runtime import GpuRuntime
from kvsidecar.movers.staging import ALIGN, Slot
from kvsidecar.movers.sums import Loaded, Sums, Trailers
from kvsidecar.movers.trailer import TRAILER_BYTES
from kvsidecar.store import Store, StoreCode
from kvsidecar.store.base import Pin, Replica
from kvsidecar_contract.placement import Chunk

__all__ = ["COPY_BYTES", "DeviceMover", "rounds"]

# A run of adjacent replicas is queued in copies of at most this much, so the first DMA starts while the rest of the
# walk goes on; each copy costs a few microseconds of host time (about 300 KB of transfer at the link's rate).
COPY_BYTES = 8 << 20


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def rounds(sizes: Sequence[int], capacity: int, bounced: Sequence[bool] = (), bounce: int = 0) -> Iterator[list[int]]:
    """Consecutive runs of indices whose values fit in capacity bytes together, each value ALIGN-aligned, and whose
    values marked in bounced fit in bounce bytes together as well (packed: a save's values copied down for sums).

    Raises ValueError for a value larger than capacity on its own (registration refuses such a layout)."""
    batch: list[int] = []
    used = down = 0
    for i, size in enumerate(sizes):
        need = _round_up(size)
        side = size if bounced and bounced[i] else 0
        if need > capacity or side > bounce:
            raise ValueError(f"a value of {size} bytes does not fit a staging area of {capacity} (bounce {bounce})")
        if used + need > capacity or down + side > bounce:
            yield batch
            batch, used, down = [], 0, 0
        batch.append(i)
        used += need
        down += side
    if batch:
        yield batch


def _buckets(chunks: Sequence[Chunk], members: Sequence[int]) -> list[tuple[tuple[int, int], list[int]]]:
    """members grouped by (group, part), in order of first appearance (each bucket is one gather or scatter)."""
    out: dict[tuple[int, int], list[int]] = {}
    for m in members:
        out.setdefault((chunks[m].group, chunks[m].part), []).append(m)
    return list(out.items())


def _even_runs(offsets: Sequence[int], size: int) -> list[tuple[int, int, int]]:
    """offsets (increasing) cut into runs of evenly spaced ones: (first index, count, step)."""
    out = []
    i = 0
    while i < len(offsets):
        count, step = 1, size
        if i + 1 < len(offsets):
            step = offsets[i + 1] - offsets[i]
            count = 2
            while i + count < len(offsets) and offsets[i + count] - offsets[i + count - 1] == step:
                count += 1
        out.append((i, count, step))
        i += count
    return out


class DeviceMover:
    """Moves a GPU memory's values through its device's staging (see the module docstring for the order of
    events). Built when the memory is registered: the copy plans, and the check that every value fits a slot."""

    def __init__(
        self, runtime: GpuRuntime, device: str, store: Store, memory: SessionMemory, metrics: Metrics, sums: Sums
    ) -> None:
        self.memory = memory
        self._runtime = runtime
        self._store = store
        self._metrics = metrics
        self._sums = sums
        self._area = runtime.area(device)
        largest = max(max(sizes) for sizes in memory.part_bytes) + TRAILER_BYTES
        fits = min(self._area.staging_bytes, self._area.bounce_bytes)
        if largest > fits:
            raise BadRequest(
                f"a stored value of this layout is {largest} bytes, larger than a slot of the daemon's GPU staging "
                f"({self._area.staging_bytes} bytes, bounce {self._area.bounce_bytes}): raise --gpu-staging-size "
                "and --gpu-bounce-size"
            )
        tensors = {key: m.tensor() for key, m in memory.mappings.items()}
        self._plans = {
            (g, p): ValueViews(templates, tensors)
            for g, per_part in enumerate(memory.templates)
            for p, templates in enumerate(per_part)
        }
        self.copies = 0  # host-to-device copies queued so far (what a load's plan cost; tests count them)

    def check(self, chunks: Sequence[Chunk]) -> None:
        """Raise BadRequest unless every chunk names a block of the memory."""
        check_chunks(self.memory, chunks)

    def close(self) -> None:
        """Drop the plans: they are views into the memory, which is unmapped next."""
        self._plans = {}

    @contextmanager
    def _slot(self) -> Iterator[Slot]:
        """A staging slot for one request; a sticky CUDA error on the way fails the GPU path and the request."""
        self._runtime.usable()
        try:
            with self._area.slot() as slot:
                yield slot
        except Exception as exc:
            reason = self._area.device.broken(exc)
            if not reason:
                raise
            self._runtime.fail(reason)
            raise DeviceUnavailable(f"the daemon's GPU path failed ({reason}); restart the daemon") from exc

    def put(
        self, keys: Sequence[str], chunks: Sequence[Chunk], pins: Sequence[Pin | None] | None = None
    ) -> list[StoreCode]:
        """Gather each round into staging, copy the chosen values down to the bounce, wait for both, seal their
        trailers from the bounce and put from staging (one put per pin asked); one code per chunk."""
        sizes = [self.memory.part_bytes[c.group][c.part] for c in chunks]
        summed = self._sums.chosen(keys)
        places = {m: k for k, m in enumerate(i for i, chosen in enumerate(summed) if chosen)}  # value -> trailer
        codes: list[StoreCode] = []
        with self._slot() as slot, self._sums.trailers(len(places)) as trailers:
            for batch in rounds(sizes, slot.staging_bytes, summed, slot.bounce_bytes):
                codes += self._put_round(slot, trailers, places, keys, chunks, sizes, batch, pins)
        return codes

    def _put_round(
        self,
        slot: Slot,
        trailers: Trailers,
        trailer_of: dict[int, int],
        keys: Sequence[str],
        chunks: Sequence[Chunk],
        sizes: Sequence[int],
        batch: list[int],
        pins: Sequence[Pin | None] | None,
    ) -> list[StoreCode]:
        places = self._gather(slot, chunks, sizes, batch)
        members = [m for m in batch if m in trailer_of]
        down = _copy_down(slot, places, sizes, members)
        slot.synchronize()  # the store's copies read staging on a thread of their own, the sums read the bounce
        if members:
            bounce = host_bytes(int(slot.bounce.data_ptr()), slot.bounce_bytes)
            sealed = self._sums.seal(
                [keys[m] for m in members],
                lambda k: [bounce[down[members[k]] : down[members[k]] + sizes[members[k]]]],
                [sizes[m] for m in members],
            )
            trailers.write(sealed, trailer_of[members[0]])  # a round's chosen values have consecutive trailers
        base = int(slot.staging.data_ptr())
        addresses = [[base + places[m]] for m in batch]
        lengths = [[sizes[m]] for m in batch]
        for i, m in enumerate(batch):
            if m in trailer_of:
                addresses[i].append(trailers.address(trailer_of[m]))
                lengths[i].append(TRAILER_BYTES)
        codes = [StoreCode.OK] * len(batch)
        for pin, these in by_pin(pins and [pins[m] for m in batch], range(len(batch))):
            try:
                got = self._store.put_from(
                    [keys[batch[i]] for i in these],
                    [addresses[i] for i in these],
                    [lengths[i] for i in these],
                    device=True,
                    pin=pin,
                )
            except StoreError as exc:
                count_failure(self._metrics, "put", exc.code)
                got = [exc.code] * len(these)
            for i, code in zip(these, got, strict=True):
                codes[i] = code
        return codes

    def _gather(self, slot: Slot, chunks: Sequence[Chunk], sizes: Sequence[int], batch: list[int]) -> dict[int, int]:
        """Queue one round's gathers into staging, bucket after bucket; where each value lands."""
        places: dict[int, int] = {}
        at = 0
        for (group, part), members in _buckets(chunks, batch):
            plan = self._plans[(group, part)]
            n, size = len(members), sizes[members[0]]
            e = plan.element
            out = slot.typed(plan.dtype)[at // e : (at + n * size) // e].view(n, size // e)
            plan.gather(slot.index([chunks[m].block_id for m in members]), out)
            for i, m in enumerate(members):
                places[m] = at + i * size
            at = _round_up(at + n * size)
        return places

    def get(self, keys: Sequence[str], chunks: Sequence[Chunk]) -> list[Loaded]:
        """Copy each value up from its replica in the segment, or through the bounce, and check it against its
        trailer; one code per chunk."""
        sizes = [self.memory.part_bytes[c.group][c.part] for c in chunks]
        trail = [TRAILER_BYTES if chosen else 0 for chosen in self._sums.chosen(keys)]
        codes: list[Loaded] = [StoreCode.OK] * len(chunks)
        segment = self._runtime.host_segment()
        located: Iterable[Replica | None] = [None] * len(chunks)
        if segment is not None:
            try:
                located = self._store.locate(keys)
            except StoreError as exc:
                count_failure(self._metrics, "locate", exc.code)  # the store reads them all instead
        elsewhere: list[int] = []
        with self._slot() as slot:
            if segment is not None:
                start = segment.replica.address
                upload = _Upload(self, slot, segment.tensor, chunks, sizes, trail)
                sealed: dict[int, int] = {}  # a value with a trailer -> its replica's offset in the segment
                for j, replica in enumerate(located):
                    if replica is None:
                        elsewhere.append(j)
                    elif replica.size != sizes[j] + trail[j]:
                        codes[j] = StoreCode.SIZE_MISMATCH
                    else:
                        upload.add(j, replica.address - start)
                        if trail[j]:
                            sealed[j] = replica.address - start
                upload.flush()
                if sealed:
                    self._check(keys, sizes, host_bytes(start, segment.replica.size), sealed, codes)
            else:
                elsewhere = list(range(len(chunks)))
            if elsewhere:
                self._read_elsewhere(slot, keys, chunks, sizes, trail, elsewhere, codes)
        return codes

    def _read_elsewhere(
        self,
        slot: Slot,
        keys: Sequence[str],
        chunks: Sequence[Chunk],
        sizes: Sequence[int],
        trail: Sequence[int],
        elsewhere: list[int],
        codes: list[Loaded],
    ) -> None:
        """Have the store read values it holds elsewhere into the bounce; copy up and scatter the ones it read."""
        base = int(slot.bounce.data_ptr())
        view = host_bytes(base, slot.bounce_bytes)
        spans = [sizes[j] + trail[j] for j in elsewhere]
        for batch in rounds(spans, min(slot.bounce_bytes, slot.staging_bytes)):
            members = [elsewhere[i] for i in batch]
            places: dict[int, int] = {}
            at = 0
            for j in members:
                places[j] = at
                at = _round_up(at + sizes[j] + trail[j])
            try:
                got: list[Loaded] = list(
                    self._store.get_into(
                        [keys[j] for j in members],
                        [[base + places[j]] for j in members],
                        [[sizes[j] + trail[j]] for j in members],
                    )
                )
            except StoreError as exc:
                count_failure(self._metrics, "get", exc.code)
                got = [exc.code] * len(members)
            for j, code in zip(members, got, strict=True):
                codes[j] = code
            # Checked in the bounce before anything is copied up: a value that fails is never scattered.
            self._check(keys, sizes, view, {j: places[j] for j in members if trail[j]}, codes)
            upload = _Upload(self, slot, slot.bounce, chunks, sizes, trail)
            for j in members:
                if codes[j] is StoreCode.OK:
                    upload.add(j, places[j])
            upload.flush()
            slot.synchronize()  # the copies above have read the bounce before the next round's get writes it

    def _check(
        self, keys: Sequence[str], sizes: Sequence[int], source: memoryview, at: dict[int, int], codes: list[Loaded]
    ) -> None:
        """Check the values at[j] bytes into source (each its bytes, then its trailer) against their trailers."""
        members = list(at)
        places = [at[j] for j in members]
        lengths = [sizes[j] for j in members]
        checked = self._sums.check(
            [keys[j] for j in members],
            [codes[j] for j in members],
            lambda i: source[places[i] + lengths[i] : places[i] + lengths[i] + TRAILER_BYTES],
            lambda i: [source[places[i] : places[i] + lengths[i]]],
            lengths,
        )
        for j, code in zip(members, checked, strict=True):
            codes[j] = code

    def plan(self, chunk: Chunk) -> ValueViews:
        """The copy plan of a chunk's value."""
        return self._plans[(chunk.group, chunk.part)]


def _copy_down(slot: Slot, places: dict[int, int], sizes: Sequence[int], members: list[int]) -> dict[int, int]:
    """Queue copies of members' values from staging down to the bounce, packed, adjacent ones at once (on a CPU
    standing in for a GPU, plain copies); where each lands in the bounce."""
    out: dict[int, int] = {}
    run: list[int] | None = None  # [staging offset, bounce offset, length] not queued yet
    at = 0
    for m in sorted(members, key=places.__getitem__):
        out[m] = at
        if run is not None and run[0] + run[2] == places[m] and run[1] + run[2] == at:
            run[2] += sizes[m]
        else:
            _queue_down(slot, run)
            run = [places[m], at, sizes[m]]
        at += sizes[m]
    _queue_down(slot, run)
    return out


def _queue_down(slot: Slot, run: list[int] | None) -> None:
    if run is not None:
        src, dst, length = run
        slot.bounce[dst : dst + length].copy_(slot.staging[src : src + length], non_blocking=True)


class _Upload:
    """One load's values copied from a host source (the segment, or the bounce) into a slot's staging, in rounds
    that fit it, and scattered into their blocks at the end of each round."""

    def __init__(
        self,
        mover: DeviceMover,
        slot: Slot,
        source: Any,
        chunks: Sequence[Chunk],
        sizes: Sequence[int],
        trail: Sequence[int],
    ) -> None:
        self._mover = mover
        self._trail = trail
        self._slot = slot
        self._source = source
        self._chunks = chunks
        self._sizes = sizes
        self._placed: list[tuple[int, int]] = []  # (chunk, staging offset) of the round under way
        self._at = 0
        self._copy: list[int] | None = None  # [source offset, staging offset, length] not queued yet

    def add(self, j: int, source_offset: int) -> None:
        """Value j, stored at source_offset in the source (its bytes, then any trailer), takes the next place in
        staging, trailer and all: adjacent stored values stay one copy."""
        span = self._sizes[j] + self._trail[j]
        e = self._mover.plan(self._chunks[j]).element
        place = -(-self._at // e) * e
        # A round ends when staging is full, or when its values' block ids would fill the index buffer (tiny values).
        if place + span > self._slot.staging_bytes or len(self._placed) == self._slot.index_capacity:
            self.flush()
            place = 0
        copy = self._copy
        if copy and copy[0] + copy[2] == source_offset and copy[1] + copy[2] == place and copy[2] < COPY_BYTES:
            copy[2] += span
        else:
            self._queue()
            self._copy = [source_offset, place, span]
        self._placed.append((j, place))
        self._at = place + span

    def _queue(self) -> None:
        if self._copy is not None:
            src, dst, length = self._copy
            self._slot.staging[dst : dst + length].copy_(self._source[src : src + length], non_blocking=True)
            self._mover.copies += 1
            self._copy = None

    def flush(self) -> None:
        """Queue the last copy and the round's scatters; staging is free for the next round after them (on S)."""
        self._queue()
        slot, chunks = self._slot, self._chunks
        buckets: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for j, place in self._placed:
            buckets.setdefault((chunks[j].group, chunks[j].part), []).append((j, place))
        for members in buckets.values():
            plan = self._mover.plan(chunks[members[0][0]])
            e, size = plan.element, self._sizes[members[0][0]]
            typed = slot.typed(plan.dtype)
            offsets = [place for _, place in members]
            for first, count, step in _even_runs(offsets, size):
                # The run's values as [count, size / e], `step` bytes apart in staging (one value per head group
                # of a block in turn, say): the scatter reads them where they lie.
                values = typed.as_strided(
                    (count, size // e), (step // e, 1), typed.storage_offset() + offsets[first] // e
                )
                plan.scatter(slot.index([chunks[j].block_id for j, _ in members[first : first + count]]), values)
        self._placed = []
        self._at = 0
