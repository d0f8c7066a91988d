"""Host memory's mover (sealed memfds, /dev/shm): every value put from and read into the engine's blocks in place,
one zero-copy batch call each, Mooncake reading and writing the slices itself; a chosen value's checksum trailer
(trailer.py) is one more buffer of the call, sealed from the blocks before the put and checked against them after
the get."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvsidecar.errors import StoreError
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.memory.slices import host_bytes
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import by_pin, check_chunks, count_failure
from kvsidecar.movers.sums import Loaded, Parts, Sums, Trailers
from kvsidecar.movers.trailer import TRAILER_BYTES
from kvsidecar.store import Store, StoreCode
from kvsidecar.store.base import Pin
from kvsidecar_contract.placement import Chunk

__all__ = ["HostMover"]

log = logging.getLogger(__name__)


class HostMover:
    """Moves a host memory's values with the store's own copies; registers the memory with the store (its RDMA
    transport reads and writes registered memory only) for as long as it moves it."""

    def __init__(self, store: Store, memory: SessionMemory, metrics: Metrics, sums: Sums) -> None:
        self.memory = memory
        self._store = store
        self._metrics = metrics
        self._sums = sums
        # Each mapping as bytes, for the sums: a value's slices are the copy plans' templates (memory/slices.py).
        self._views = {key: host_bytes(m.address, m.size) for key, m in memory.mappings.items()}
        self._registered: list[int] = []
        try:
            for m in memory.mappings.values():
                store.register_buffer(m.address, m.size)
                self._registered.append(m.address)
        except BaseException:
            self.close()
            raise

    def check(self, chunks: Sequence[Chunk]) -> None:
        """Raise BadRequest unless every chunk names a block of the memory."""
        check_chunks(self.memory, chunks)

    def put(
        self, keys: Sequence[str], chunks: Sequence[Chunk], pins: Sequence[Pin | None] | None = None
    ) -> list[StoreCode]:
        """One batch put per pin asked, straight from the blocks' slices; a chosen value's trailer (sealed from
        them) after them."""
        sums = self._sums
        members = sums.members(keys)
        addresses, sizes = self._buffers(chunks)
        if not members:  # no value of the batch carries a trailer: most batches of sampled checksums, all of off
            return self._put(keys, addresses, sizes, pins)
        with sums.trailers(len(members)) as trailers:
            _trail(members, trailers, addresses, sizes)
            value_bytes = self._value_bytes([chunks[i] for i in members])
            sealed = sums.seal([keys[i] for i in members], lambda k: self._bytes(chunks[members[k]]), value_bytes)
            trailers.write(sealed)
            return self._put(keys, addresses, sizes, pins)

    def _put(
        self,
        keys: Sequence[str],
        addresses: list[list[int]],
        sizes: list[list[int]],
        pins: Sequence[Pin | None] | None,
    ) -> list[StoreCode]:
        """One batch put per pin asked (pins None: one, of them all, ordinary cache)."""
        if pins is None:
            return self._put_batch(keys, addresses, sizes, None)
        codes = [StoreCode.OK] * len(keys)
        for pin, these in by_pin(pins, range(len(keys))):
            got = self._put_batch(
                [keys[n] for n in these], [addresses[n] for n in these], [sizes[n] for n in these], pin
            )
            for n, code in zip(these, got, strict=True):
                codes[n] = code
        return codes

    def _put_batch(
        self, keys: Sequence[str], addresses: list[list[int]], sizes: list[list[int]], pin: Pin | None
    ) -> list[StoreCode]:
        try:
            return self._store.put_from(keys, addresses, sizes, pin=pin)
        except StoreError as exc:
            count_failure(self._metrics, "put", exc.code)
            return [exc.code] * len(keys)

    def get(self, keys: Sequence[str], chunks: Sequence[Chunk]) -> list[Loaded]:
        """One batch get straight into the blocks' slices (a chosen value's trailer after them), then each chosen
        value read checked against its trailer there."""
        sums = self._sums
        members = sums.members(keys)
        addresses, sizes = self._buffers(chunks)
        if not members:
            return self._get(keys, addresses, sizes)
        with sums.trailers(len(members)) as trailers:
            _trail(members, trailers, addresses, sizes)
            trailers.clear(len(members))
            codes = self._get(keys, addresses, sizes)
            checked = sums.check(
                [keys[i] for i in members],
                [codes[i] for i in members],
                trailers.trailer,
                lambda k: self._bytes(chunks[members[k]]),
                self._value_bytes([chunks[i] for i in members]),
            )
        for i, code in zip(members, checked, strict=True):
            codes[i] = code
        return codes

    def _get(self, keys: Sequence[str], addresses: list[list[int]], sizes: list[list[int]]) -> list[Loaded]:
        try:
            return list(self._store.get_into(keys, addresses, sizes))
        except StoreError as exc:
            count_failure(self._metrics, "get", exc.code)
            return [exc.code] * len(keys)

    def _buffers(self, chunks: Sequence[Chunk]) -> tuple[list[list[int]], list[list[int]]]:
        """Each value's buffers: its slices."""
        buffers = self.memory.buffers
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        for c in chunks:
            a, s = buffers(c.group, c.block_id, c.part)
            addresses.append(a)
            sizes.append(s)
        return addresses, sizes

    def _value_bytes(self, chunks: Sequence[Chunk]) -> list[int]:
        part_bytes = self.memory.part_bytes
        return [part_bytes[c.group][c.part] for c in chunks]

    def _bytes(self, chunk: Chunk) -> Parts:
        """A checked chunk's value as it lies in the blocks, slice by slice."""
        b, views = chunk.block_id, self._views
        return [
            views[t.mapping][t.offset + b * t.stride : t.offset + b * t.stride + t.length]
            for t in self.memory.templates[chunk.group][chunk.part]
        ]

    def close(self) -> None:
        """Unregister the memory from the store (best effort: it is going away, and the store may be down)."""
        for address in self._registered:
            try:
                self._store.unregister_buffer(address)
            except Exception as exc:
                log.warning("could not unregister buffer %#x from the store: %s", address, exc)
        self._registered = []
        self._views = {}


def _trail(members: Sequence[int], trailers: Trailers, addresses: list[list[int]], sizes: list[list[int]]) -> None:
    """The members' trailers (in order) after their values' slices, as one more buffer each."""
    for k, i in enumerate(members):
        addresses[i].append(trailers.address(k))
        sizes[i].append(TRAILER_BYTES)
