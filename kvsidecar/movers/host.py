"""Host memory's mover (sealed memfds, /dev/shm): every value put from and read into the engine's blocks in place,
one zero-copy batch call each, Mooncake reading and writing the slices itself."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvsidecar.errors import StoreError
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.base import by_pin, check_chunks, count_failure
from kvsidecar.store import Store, StoreCode
from kvsidecar.store.base import Pin
from kvsidecar_contract.placement import Chunk

__all__ = ["HostMover"]

log = logging.getLogger(__name__)


class HostMover:
    """Moves a host memory's values with the store's own copies; registers the memory with the store (its RDMA
    transport reads and writes registered memory only) for as long as it moves it."""

    def __init__(self, store: Store, memory: SessionMemory, metrics: Metrics) -> None:
        self.memory = memory
        self._store = store
        self._metrics = metrics
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
        """One batch put per pin asked, straight from the blocks' slices."""
        addresses, sizes = self._buffers(chunks)
        codes = [StoreCode.OK] * len(keys)
        for pin, these in by_pin(pins, range(len(keys))):
            try:
                got = self._store.put_from(
                    [keys[n] for n in these], [addresses[n] for n in these], [sizes[n] for n in these], pin=pin
                )
            except StoreError as exc:
                count_failure(self._metrics, "put", exc.code)
                got = [exc.code] * len(these)
            for n, code in zip(these, got, strict=True):
                codes[n] = code
        return codes

    def get(self, keys: Sequence[str], chunks: Sequence[Chunk]) -> list[StoreCode]:
        """One batch get straight into the blocks' slices."""
        addresses, sizes = self._buffers(chunks)
        try:
            return self._store.get_into(keys, addresses, sizes)
        except StoreError as exc:
            count_failure(self._metrics, "get", exc.code)
            return [exc.code] * len(keys)

    def _buffers(self, chunks: Sequence[Chunk]) -> tuple[list[list[int]], list[list[int]]]:
        buffers = self.memory.buffers
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        for c in chunks:
            a, s = buffers(c.group, c.block_id, c.part)
            addresses.append(a)
            sizes.append(s)
        return addresses, sizes

    def close(self) -> None:
        """Unregister the memory from the store (best effort: it is going away, and the store may be down)."""
        for address in self._registered:
            try:
                self._store.unregister_buffer(address)
            except Exception as exc:
                log.warning("could not unregister buffer %#x from the store: %s", address, exc)
        self._registered = []
