"""The in-process baseline: the only bench code that calls Mooncake itself (everything else goes through the daemon).

`DirectClient` is a `MooncakeDistributedStore` driven the way vLLM's in-tree Mooncake store connector drives it from
inside the rank: its own segment (or, as a dummy client, Mooncake's `mooncake_client` process), buffers registered
once, batch existence checks, batch puts from and gets into the engine's buffers. The paths built on it are the
ones the daemon is compared with: in-process Mooncake and Mooncake's real client.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvsidecar.store.mooncake_store import prefix_regex
from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.machine import process_stats
from kvsidecar_bench.paths import Clock, Timing, model_name
from kvsidecar_bench.shapes import EngineMemory, ModelShape, Request
from kvsidecar_contract.placement import Geometry, key_prefix
from kvsidecar_contract.placement.keys import KEY_TAIL_PATTERN
from kvsidecar_testing.processes import StorageNode

__all__ = ["DirectClient", "InProcessPath", "RealClientPath", "native_output_to"]

LOCAL_BUFFER = 16 << 20


@contextlib.contextmanager
def native_output_to(path: Path) -> Iterator[None]:
    """Send what native code writes to fd 2 (Mooncake's glog lines) to a file while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class DirectClient:
    """One MooncakeDistributedStore of the bench process, and the batch calls the baseline makes."""

    def __init__(self, logs: Path) -> None:
        from kvsidecar.store.native import ensure_native_libs

        ensure_native_libs()
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.logs = logs
        self.native: Any = MooncakeDistributedStore()
        self.config = ReplicateConfig()
        self.config.replica_num = 1

    @classmethod
    def with_segment(cls, logs: Path, master: str, segment_size: int) -> DirectClient:
        """A client with a segment of its own (segment_size 0: none, it only asks the master)."""
        client = cls(logs)
        with native_output_to(logs):
            rc = client.native.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, LOCAL_BUFFER, "tcp", "", master)
        if rc != 0:
            raise BenchError(f"in-process Mooncake setup returned {rc}")
        return client

    @classmethod
    def dummy(cls, logs: Path, real: StorageNode, pool_bytes: int) -> tuple[DirectClient, int]:
        """A dummy client of `real` with a registered shared-memory pool; returns it and the pool's address."""
        client = cls(logs)
        if not hasattr(client.native, "setup_dummy"):
            raise BenchError("this Mooncake wheel has no dummy-client mode")
        with native_output_to(logs):
            rc = client.native.setup_dummy(pool_bytes, LOCAL_BUFFER, real.address)
        if rc != 0:
            raise BenchError(f"setup_dummy returned {rc}")
        pool = int(client.native.alloc_from_mem_pool(pool_bytes))
        if not pool:
            raise BenchError("the dummy client's memory pool has no room")
        client.register(pool, pool_bytes)
        return client, pool

    def register(self, address: int, size: int) -> None:
        rc = self.native.register_buffer(address, size)
        if rc != 0:
            raise BenchError(f"register_buffer returned {rc}")

    def unregister(self, address: int) -> None:
        self.native.unregister_buffer(address)

    def exist(self, keys: Sequence[str]) -> list[int]:
        """1 per key that exists."""
        return list(self.native.batch_is_exist(list(keys)))

    def put_missing(
        self, keys: Sequence[str], addresses: Sequence[list[int]], sizes: list[int]
    ) -> tuple[int, list[int]]:
        """Check existence in one batch, put the missing values in one more; (how many were put, their codes)."""
        present = self.exist(keys)
        todo = [i for i, p in enumerate(present) if p != 1]
        codes = self.native.batch_put_from_multi_buffers(
            [keys[i] for i in todo], [addresses[i] for i in todo], [sizes] * len(todo), self.config
        )
        return len(todo), list(codes)

    def get_into(self, keys: Sequence[str], addresses: Sequence[list[int]], sizes: list[int]) -> list[int]:
        """Bytes read per key."""
        return list(self.native.batch_get_into_multi_buffers(list(keys), list(addresses), [sizes] * len(keys)))

    def remove_model(self, model: str) -> int:
        """Remove every key of one model (no cache prefix), by the key format's exact shape."""
        pattern = prefix_regex(key_prefix(model, "")) + f"({KEY_TAIL_PATTERN})$"
        removed = int(self.native.remove_by_regex(pattern, True))
        if removed < 0:
            raise BenchError(f"remove_by_regex({pattern!r}) returned {removed}")
        return removed

    def close(self) -> None:
        with native_output_to(self.logs):
            self.native.close()


class _BatchPath:
    """The rank itself calls Mooncake's batch API, as vLLM's in-tree Mooncake store connector does.

    Keys and addresses come from the same placement code the daemon runs; a save checks existence in one batch and
    puts the missing values from the engine's buffers, a load gets straight into them.
    """

    name = ""

    def __init__(self, client: DirectClient, others: Callable[[], float] | None = None) -> None:
        self.client = client
        self._clock = Clock(others)
        self._geo: Geometry | None = None
        self._model = ""
        self.memory: EngineMemory | None = None

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        return memory

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        self._model = model_name(shape)
        self._geo = Geometry.of(shape.layout(self._model))
        self.memory = self._memory_for(shape, memory)

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        geo, memory, client = self._geo, self.memory, self.client
        assert geo is not None and memory is not None

        def run() -> list[int]:
            chunks = request.save_chunks(geo)
            addresses = [memory.addresses(c.block_id) for c in chunks]
            return client.put_missing([c.key for c in chunks], addresses, memory.sizes)[1]

        codes, timing = self._clock.run(run)
        if len(codes) != len(request.save_ids) or any(codes):
            raise BenchError(f"{self.name} put returned {sorted(set(codes))} for {len(request.save_ids)} blocks")
        return timing

    def load(self, request: Request) -> Timing:
        geo, memory, client = self._geo, self.memory, self.client
        assert geo is not None and memory is not None

        def run() -> list[int]:
            chunks = request.load_chunks(geo)
            return client.get_into(
                [c.key for c in chunks], [memory.addresses(c.block_id) for c in chunks], memory.sizes
            )

        counts, timing = self._clock.run(run)
        expected = memory.shape.value_bytes
        if len(counts) != len(request.load_ids) or any(c != expected for c in counts):
            raise BenchError(f"{self.name} get returned {sorted(set(counts))}, expected {expected} per block")
        return timing

    def clear(self) -> None:
        self.client.remove_model(self._model)

    def end(self) -> None:
        self.memory = None

    def close(self) -> None:
        self.end()
        self.client.close()


class InProcessPath(_BatchPath):
    """A Mooncake client inside the rank with its own segment (vLLM's in-tree connector)."""

    name = "in-process"

    def __init__(self, logs: Path, master: str, segment_size: int) -> None:
        super().__init__(DirectClient.with_segment(logs, master, segment_size))
        self._registered: list[int] = []

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        # The same call for GPU memory (--device cuda): Mooncake's CUDA build finds a device pointer's location
        # itself (cudaPointerGetAttributes) and its TCP transport stages device memory through cudaMemcpy.
        for base, size in memory.buffers():
            self.client.register(base, size)
        self._registered = list(memory.bases)
        return memory

    def end(self) -> None:
        for base in self._registered:
            self.client.unregister(base)
        self._registered = []
        super().end()


class RealClientPath(_BatchPath):
    """A dummy client in the rank, Mooncake's `mooncake_client` process as the sidecar that moves the bytes.

    Dummy clients can only hand the real client buffers from their shared memory pool, so this path's engine
    memory is a copy of the same blocks in that pool, with the same layout.
    """

    name = "real-client"

    def __init__(self, logs: Path, real: StorageNode, pool_bytes: int) -> None:
        client, self._pool = DirectClient.dummy(logs, real, pool_bytes)
        super().__init__(client, lambda: process_stats(real.pid).cpu_s)

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        mine = EngineMemory.at(shape, memory.num_blocks, self._pool)
        mine.copy_from(memory)
        return mine
