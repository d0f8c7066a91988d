"""The compared data paths: through the daemon, in-process Mooncake, Mooncake's real client, and memcpy.

Every path saves a request's blocks from engine memory and loads them back into other blocks of the same memory,
with the same batch per request; each times only what its user would wait for and reports the CPU it cost.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kvsidecar.bench.procs import BenchError, DaemonProcess, RealClientProcess, native_output_to
from kvsidecar.bench.shapes import BLOCK_TOKENS, EngineMemory, ModelShape, Request
from kvsidecar.store.mooncake_store import prefix_regex
from kvsidecar_contract.placement import Geometry, key_prefix

__all__ = ["DaemonPath", "DataPath", "InProcessPath", "MemcpyPath", "RealClientPath", "Timing", "model_name"]

_LOCAL_BUFFER = 16 << 20


class Timing(NamedTuple):
    """Wall time the caller waited, and CPU seconds every process on the path spent meanwhile."""

    wall_s: float
    cpu_s: float


def model_name(shape: ModelShape) -> str:
    """The model name every path stores a shape's blocks under (so their keys are identical)."""
    return f"bench/{shape.name}"


class DataPath(Protocol):
    """One way to move a rank's blocks between its memory and a store."""

    name: str
    memory: EngineMemory | None  # the engine memory this path moves (the real client's is a copy in its pool)

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        """Get ready to move this shape's blocks from and to `memory`."""

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        """Write the request's blocks; `fresh`: into memory never touched before (memcpy only)."""
        ...

    def load(self, request: Request) -> Timing:
        """Read the request's blocks back into its load ids."""
        ...

    def clear(self) -> None:
        """Forget everything saved for this shape, untimed."""

    def end(self) -> None:
        """Release what `begin` took."""

    def close(self) -> None:
        """Release the path."""


class _Clock:
    """Wall and CPU time of a block, with CPU of other processes read from /proc (coarse: summed over rounds)."""

    def __init__(self, others: Callable[[], float] | None = None) -> None:
        self._others = others

    def run(self, fn: Callable[[], Any]) -> tuple[Any, Timing]:
        other0 = self._others() if self._others else 0.0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if self._others:
            cpu += self._others() - other0
        return out, Timing(wall, cpu)


class DaemonPath:
    """client -> gRPC (Unix socket) -> daemon -> Mooncake, the way an engine rank uses kvsidecar."""

    name = "daemon"

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self._clock = _Clock(lambda: daemon.stats().cpu_s)
        self._client: Any = None
        self._tp_size = 1
        self.memory: EngineMemory | None = None

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

        self._client = SidecarClient.connect(
            self.daemon.target,
            model=model_name(shape),
            layout=EngineLayout(tp_size=shape.tp_size, tp_rank=shape.tp_rank),
            num_kv_heads=shape.kv_heads,
            hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec(shape.group, BLOCK_TOKENS)],
            client_name="kvsidecar-bench",
        )
        self._client.register(memory.tensors, [(0,)] * len(memory.tensors))
        self._tp_size = shape.tp_size
        self.memory = memory

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        client = self._client
        result, timing = self._clock.run(
            lambda: client.save(request.hashes, [request.save_ids], request.num_tokens).result()
        )
        if result.written != len(request.save_ids) or result.failed:
            raise BenchError(f"daemon save wrote {result.written} of {len(request.save_ids)} blocks: {result}")
        return timing

    def load(self, request: Request) -> Timing:
        from kvsidecar_client import Hit

        client = self._client
        tokens = len(request.hashes) * BLOCK_TOKENS
        if self._tp_size == 1:
            hit = client.lookup(request.hashes, request.num_tokens)  # the scheduler's step, not the load's
            if hit.hit_tokens != tokens:
                raise BenchError(f"daemon lookup hit {hit.hit_tokens} tokens of {tokens}")
        else:
            # A TP rank's lookup needs every rank's shard; this rank's own blocks are what a full hit reads.
            hit = Hit(tokens, (tokens,))
        result, timing = self._clock.run(lambda: client.load_detailed(request.hashes, [request.load_ids], hit))
        if result.loaded != len(request.load_ids) or result.failures:
            raise BenchError(f"daemon load read {result.loaded} of {len(request.load_ids)} blocks: {result}")
        return timing

    def clear(self) -> None:
        self._client.reset()

    def end(self) -> None:
        self.memory = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        self.end()


class _MooncakeBatchPath:
    """The rank itself calls Mooncake's batch API, as vLLM's in-tree Mooncake store connector does.

    Keys and addresses come from the same placement code the daemon runs; a save checks existence in one batch and
    puts the missing values from the engine's buffers, a load gets straight into them.
    """

    name = ""

    def __init__(self, logs: Path, others: Callable[[], float] | None = None) -> None:
        from kvsidecar.store.native import ensure_native_libs

        ensure_native_libs()
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._logs = logs
        self.store: Any = MooncakeDistributedStore()
        self._config = ReplicateConfig()
        self._config.replica_num = 1
        self._clock = _Clock(others)
        self._geo: Geometry | None = None
        self.memory: EngineMemory | None = None
        self._prefix = ""

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        return memory

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        layout = shape.layout(model_name(shape))
        self._geo = Geometry.of(layout)
        self._prefix = key_prefix(layout.model, "")
        self.memory = self._memory_for(shape, memory)

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        geo, memory, store, config = self._geo, self.memory, self.store, self._config
        assert geo is not None and memory is not None

        def run() -> list[int]:
            chunks = request.save_chunks(geo)
            keys = [c.key for c in chunks]
            present = store.batch_is_exist(keys)
            todo = [i for i, p in enumerate(present) if p != 1]
            return list(
                store.batch_put_from_multi_buffers(
                    [keys[i] for i in todo],
                    [memory.addresses(chunks[i].block_id) for i in todo],
                    [memory.sizes] * len(todo),
                    config,
                )
            )

        codes, timing = self._clock.run(run)
        if len(codes) != len(request.save_ids) or any(codes):
            raise BenchError(f"{self.name} put returned {sorted(set(codes))} for {len(request.save_ids)} blocks")
        return timing

    def load(self, request: Request) -> Timing:
        geo, memory, store = self._geo, self.memory, self.store
        assert geo is not None and memory is not None

        def run() -> list[int]:
            chunks = request.load_chunks(geo)
            return list(
                store.batch_get_into_multi_buffers(
                    [c.key for c in chunks],
                    [memory.addresses(c.block_id) for c in chunks],
                    [memory.sizes] * len(chunks),
                )
            )

        counts, timing = self._clock.run(run)
        expected = memory.shape.value_bytes
        if len(counts) != len(request.load_ids) or any(c != expected for c in counts):
            raise BenchError(f"{self.name} get returned {sorted(set(counts))}, expected {expected} per block")
        return timing

    def clear(self) -> None:
        removed = self.store.remove_by_regex(prefix_regex(self._prefix), True)
        if removed < 0:
            raise BenchError(f"{self.name} remove_by_regex returned {removed}")

    def end(self) -> None:
        self.memory = None

    def close(self) -> None:
        self.end()
        with native_output_to(self._logs):
            self.store.close()


class InProcessPath(_MooncakeBatchPath):
    """A Mooncake client inside the rank with its own segment (vLLM's in-tree connector)."""

    name = "in-process"

    def __init__(self, logs: Path, master: str, segment_size: int) -> None:
        super().__init__(logs)
        with native_output_to(logs):
            rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, _LOCAL_BUFFER, "tcp", "", master)
        if rc != 0:
            raise BenchError(f"in-process Mooncake setup returned {rc}")
        self._registered: list[int] = []

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        memory.register_with(self.store)
        self._registered = list(memory.bases)
        return memory

    def end(self) -> None:
        for base in self._registered:
            self.store.unregister_buffer(base)
        self._registered = []
        super().end()


class RealClientPath(_MooncakeBatchPath):
    """A dummy client in the rank, Mooncake's `mooncake_client` process as the sidecar that moves the bytes.

    Dummy clients can only hand the real client buffers from their shared memory pool, so this path's engine
    memory is a copy of the same blocks in that pool, with the same layout.
    """

    name = "real-client"

    def __init__(self, logs: Path, real: RealClientProcess, pool_bytes: int) -> None:
        super().__init__(logs, lambda: real.stats().cpu_s)
        if not hasattr(self.store, "setup_dummy"):
            raise BenchError("this Mooncake wheel has no dummy-client mode")
        with native_output_to(logs):
            rc = self.store.setup_dummy(pool_bytes, _LOCAL_BUFFER, real.address)
        if rc != 0:
            raise BenchError(f"setup_dummy returned {rc}")
        self._pool = int(self.store.alloc_from_mem_pool(pool_bytes))
        if not self._pool:
            raise BenchError("the dummy client's memory pool has no room")
        rc = self.store.register_buffer(self._pool, pool_bytes)
        if rc != 0:
            raise BenchError(f"register_buffer of the memory pool returned {rc}")

    def _memory_for(self, shape: ModelShape, memory: EngineMemory) -> EngineMemory:
        mine = EngineMemory.at(shape, memory.num_blocks, self._pool)
        mine.copy_from(memory)
        return mine


class MemcpyPath:
    """The physical limit: the same bytes copied by one core, one contiguous copy per tensor (torch), and back."""

    name = "memcpy"

    def __init__(self, max_bytes: int) -> None:
        import torch

        # Warm: touched once here, like segment memory that has been written before.
        self._warm = torch.empty(max_bytes, dtype=torch.uint8)
        self._warm.fill_(0)
        self.memory: EngineMemory | None = None

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        self.memory = memory

    def _staging(self, n: int, fresh: bool) -> tuple[Any, mmap.mmap | None]:
        import torch

        memory = self.memory
        assert memory is not None
        shape = memory.shape
        nbytes = n * shape.value_bytes
        area = mmap.mmap(-1, nbytes) if fresh else None
        flat = self._warm[:nbytes] if area is None else torch.frombuffer(area, dtype=torch.uint8)
        # Region-major: tensor r's n blocks are one contiguous run, so each copy is a plain memcpy.
        return flat.view(shape.regions, n * shape.slice_bytes), area

    def _blocks(self, tensor: Any, first: int, n: int) -> Any:
        import torch

        return tensor[first : first + n].view(torch.uint8).reshape(-1)

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        memory = self.memory
        assert memory is not None
        n, first = len(request.save_ids), request.save_ids[0]
        staging, area = self._staging(n, fresh)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for r, tensor in enumerate(memory.tensors):
            staging[r].copy_(self._blocks(tensor, first, n))
        timing = Timing(time.perf_counter() - t0, time.process_time() - cpu0)
        if area is not None:
            del staging
            area.close()
        return timing

    def load(self, request: Request) -> Timing:
        memory = self.memory
        assert memory is not None
        n, first = len(request.load_ids), request.load_ids[0]
        staging, _ = self._staging(n, False)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for r, tensor in enumerate(memory.tensors):
            self._blocks(tensor, first, n).copy_(staging[r])
        return Timing(time.perf_counter() - t0, time.process_time() - cpu0)

    def clear(self) -> None:
        pass

    def end(self) -> None:
        self.memory = None

    def close(self) -> None:
        self.end()
