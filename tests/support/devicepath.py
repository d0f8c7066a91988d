"""The device mover with a CPU standing in for the GPU: a rank's KV cache in /dev/shm, a session over a given store,
and the same data path the daemon runs on a GPU node (staging slots, plans, rounds, direct copies of the segment).

What it cannot show is CUDA itself (streams running ahead, page-locking, IPC): tests/gpu checks that on a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory

from prometheus_client import CollectorRegistry

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.metrics import Metrics
from kvsidecar.movers.accelerators import Accelerator
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.runtime import GpuRuntime, GpuSettings
from kvsidecar.movers.trailer import ChecksumSettings
from kvsidecar.sessions.registry import SessionRegistry
from kvsidecar.sessions.session import Session
from kvsidecar.store import Store
from kvsidecar.values import LoadArgs, RegionRequest, Role, SaveArgs, ShmHandle
from kvsidecar_contract.placement import GroupSpec, Kind, Layout, Parallel
from kvsidecar_testing.hashes import chained_hashes

KiB = 1 << 10
BLOCK_TOKENS = 16


@dataclass
class Rank:
    """One rank's memory (one /dev/shm segment, vLLM-like: every layer a view of it) and its session."""

    segment: shared_memory.SharedMemory
    session: Session
    datapath: DataPath
    registry: SessionRegistry
    regions: list[RegionRequest]
    runtime: GpuRuntime | None
    metrics: Metrics

    def fill(self, seed: int) -> None:
        """Distinct bytes everywhere (which block and which byte each came from)."""
        data = bytearray(len(self.segment.buf))
        for i in range(0, len(data), 4):
            data[i : i + 4] = ((seed * 2654435761 + i) & 0xFFFFFFFF).to_bytes(4, "little")
        self.segment.buf[:] = bytes(data)

    def value(self, group: int, block: int) -> bytes:
        """The bytes of a block as the host path addresses them (the oracle): its values, every part of it."""
        memory = self.session.require_memory()
        out = []
        for part in range(len(memory.part_bytes[group])):
            addresses, sizes = memory.buffers(group, block, part)
            out += [ctypes.string_at(a, n) for a, n in zip(addresses, sizes, strict=True)]
        return b"".join(out)

    def save(self, hashes: Sequence[bytes], ids: Sequence[Sequence[int]]):  # type: ignore[no-untyped-def]
        return self.datapath.save(self.session, SaveArgs(hashes, ids, len(hashes) * BLOCK_TOKENS))

    def load(self, hashes: Sequence[bytes], ids: Sequence[Sequence[int]]):  # type: ignore[no-untyped-def]
        tokens = len(hashes) * BLOCK_TOKENS
        groups = len(self.session.layout.groups)
        return self.datapath.load(self.session, LoadArgs(hashes, ids, tokens, (tokens,) * groups))


def layers(
    segment: shared_memory.SharedMemory, n: int, block_bytes: int, blocks: int, group: int, heads: int = 0
) -> list[RegionRequest]:
    """n layers of one buffer, layer-major (vLLM 0.33's allocation): one region each, one run for the views."""
    handle, size, layer = ShmHandle(segment.name), len(segment.buf), block_bytes * blocks
    return [RegionRequest(handle, size, i * layer, block_bytes, block_bytes, blocks, (group,), heads) for i in range(n)]


@contextmanager
def rank(
    store: Store,
    *,
    groups: Sequence[GroupSpec] = (GroupSpec(Kind.FULL_ATTENTION, BLOCK_TOKENS),),
    device: bool = True,
    layers_per_group: int = 4,
    block_bytes: int = 4 * KiB,
    blocks: int = 32,
    staging_bytes: int = 1 << 20,
    bounce_bytes: int = 256 * KiB,
    model: str = "dev/model",
    accelerator: Accelerator | None = None,
    heads: int = 0,
    checksums: ChecksumSettings | None = None,
) -> Iterator[Rank]:
    """A rank on the device path (device=False: the host path, the same memory layout) over store; staging and
    bounce are the device's whole area (SLOTS slots); accelerator: a stand-in CPU of the test's own; heads: KV
    heads of every block, each block stored as one value per head (rule 11, shared across TP sizes); checksums: the
    daemon's --checksums (its default without)."""
    per_group = layers_per_group * block_bytes * blocks
    segment = shared_memory.SharedMemory(create=True, size=per_group * len(groups))
    segment.buf[:] = bytes(len(segment.buf))
    metrics = Metrics(CollectorRegistry())
    runtime = None
    if device:
        given = [accelerator] if accelerator is not None else None
        runtime = GpuRuntime(GpuSettings("cpu", staging_bytes, bounce_bytes), store, metrics, devices=given)
        runtime.start()
    registry = SessionRegistry(60, Movers(store, metrics, runtime, checksums), metrics=metrics)
    regions = []
    for g in range(len(groups)):
        for r in layers(segment, layers_per_group, block_bytes, blocks, g, heads):
            regions.append(dataclasses.replace(r, offset=r.offset + g * per_group))
    layout = Layout(model, tuple(groups), Parallel(), max(heads, 1), BLOCK_TOKENS, share_tp_size=heads)
    session = registry.open(Role.RANK, layout, 32, "device-path-test", grant=_trusted())
    registry.attach(session, regions)
    try:
        yield Rank(segment, session, DataPath(store, metrics), registry, regions, runtime, metrics)
    finally:
        registry.close_all()
        if runtime is not None:
            runtime.stop()
        segment.close()
        segment.unlink()


def _trusted():  # type: ignore[no-untyped-def]
    from kvsidecar.tenancy.live import Grant
    from kvsidecar.tenancy.table import SINGLE_TENANT

    return Grant(SINGLE_TENANT, shm_names=True)


def hashes(tag: str, n: int) -> list[bytes]:
    """n chained block hashes of a prompt of its own."""
    return chained_hashes(tag, n)
