"""The compared data paths: through the daemon, and memcpy (in-process Mooncake and its real client: mooncake_direct).

Every path saves a request's blocks from engine memory and loads them back into other blocks of the same memory,
with the same batch per request; each times only what its user would wait for and reports the CPU it cost.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from kvsidecar_bench.errors import BenchError
from kvsidecar_bench.machine import process_stats
from kvsidecar_bench.shapes import BLOCK_TOKENS, EngineMemory, ModelShape, Request
from kvsidecar_testing.processes import DaemonProcess

__all__ = ["Clock", "DaemonPath", "DataPath", "GatherDmaPath", "MemcpyPath", "Timing", "model_name"]


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


class Clock:
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
    """client -> data socket (saves and loads; gRPC for the rest) -> daemon -> Mooncake, the way an engine rank uses
    kvsidecar; with data_socket=False every call goes over gRPC ("daemon-grpc": what the data socket saves)."""

    def __init__(self, daemon: DaemonProcess, *, data_socket: bool = True) -> None:
        self.daemon = daemon
        self.name = "daemon" if data_socket else "daemon-grpc"
        self._data_socket = data_socket
        self._clock = Clock(lambda: process_stats(daemon.pid).cpu_s)
        self._client: Any = None
        self._tp_size = 1
        self.memory: EngineMemory | None = None

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

        if not self._data_socket:
            # Beside the default daemon path on the same daemon: a session registers only memory of its own, and
            # keys of its own keep one path's saves from finding the other's values stored.
            own = EngineMemory.allocate(shape, memory.num_blocks, 0, memory.device)
            for mine, theirs in zip(own.tensors, memory.tensors, strict=True):
                mine.copy_(theirs)
            memory = own
        self._client = SidecarClient.connect(
            self.daemon.target,
            model=model_name(shape) + ("" if self._data_socket else "/grpc"),
            layout=EngineLayout(tp_size=shape.tp_size, tp_rank=shape.tp_rank),
            num_kv_heads=shape.kv_heads,
            hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec(shape.group, BLOCK_TOKENS)],
            client_name="kvsidecar-bench",
            data_socket=self._data_socket,
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


class MemcpyPath:
    """The physical limit: the same bytes copied by one core, one contiguous copy per tensor (torch), and back.

    With `device="cuda"` the engine memory is on the GPU and each copy is a synchronous device-to-host cudaMemcpy
    (torch's copy_ into pinned host memory, then torch.cuda.synchronize() inside the timed region), host-to-device
    on load; a cold save copies into freshly mapped pageable pages, as a store's cold segment is.
    """

    name = "memcpy"

    def __init__(self, max_bytes: int, device: str = "cpu") -> None:
        import torch

        self._cuda = device == "cuda"
        # Warm: touched once here, like segment memory that has been written before; pinned for a GPU, so the copy
        # is one DMA transfer (cudaMemcpy from pageable memory is staged through a driver buffer).
        self._warm = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._warm.fill_(0)
        self.memory: EngineMemory | None = None

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()

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
            staging[r].copy_(self._blocks(tensor, first, n), non_blocking=False)
        self._sync()
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
            self._blocks(tensor, first, n).copy_(staging[r], non_blocking=False)
        self._sync()
        return Timing(time.perf_counter() - t0, time.process_time() - cpu0)

    def clear(self) -> None:
        pass

    def end(self) -> None:
        self.memory = None

    def close(self) -> None:
        self.end()


class GatherDmaPath:
    """The GPU's limit for vLLM-layout blocks: one gather kernel of the request's blocks into device staging and one
    DMA into pinned host memory (save); one DMA up and one scatter kernel (load), synchronized, in this process.

    What the daemon's device path does, without a daemon, a store, a key or a socket: the bound it is judged by.
    """

    name = "gather+dma"

    def __init__(self, max_bytes: int) -> None:
        import torch

        self._torch = torch
        self._staging = torch.empty(max_bytes, dtype=torch.uint8, device="cuda:0")
        self._host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
        self._host.fill_(0)
        self.memory: EngineMemory | None = None
        self._view: Any = None

    def begin(self, shape: ModelShape, memory: EngineMemory) -> None:
        self.memory = memory
        self._view = memory.blocks_view()

    def _staged(self, n: int) -> tuple[Any, Any]:
        view = self._view
        nbytes = n * view.shape[1] * view.shape[2] * 8
        typed = self._staging[:nbytes].view(self._torch.int64).view(n, view.shape[1], view.shape[2])
        return typed, nbytes

    def save(self, request: Request, *, fresh: bool = False) -> Timing:
        torch = self._torch
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        index = torch.tensor(request.save_ids, dtype=torch.int64, device="cuda:0")
        typed, nbytes = self._staged(len(request.save_ids))
        torch.index_select(self._view, 0, index, out=typed)
        self._host[:nbytes].copy_(self._staging[:nbytes], non_blocking=True)
        torch.cuda.synchronize()
        return Timing(time.perf_counter() - t0, time.process_time() - cpu0)

    def load(self, request: Request) -> Timing:
        torch = self._torch
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        index = torch.tensor(request.load_ids, dtype=torch.int64, device="cuda:0")
        typed, nbytes = self._staged(len(request.load_ids))
        self._staging[:nbytes].copy_(self._host[:nbytes], non_blocking=True)
        self._view.index_copy_(0, index, typed)
        torch.cuda.synchronize()
        return Timing(time.perf_counter() - t0, time.process_time() - cpu0)

    def clear(self) -> None:
        pass

    def end(self) -> None:
        self.memory = None
        self._view = None

    def close(self) -> None:
        self.end()
