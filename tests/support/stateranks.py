"""Engines of any TP size in the test process: rank sessions over plain memory, saving and loading through the
daemon's own DataPath into one in-memory store, every block's bytes taken from the byte oracles.

What each rank's memory holds is written from the engine's side (`kvsidecar_testing.states` for recurrent state,
whole-model elements sliced by head below for attention, the latent whole on every rank for MLA), never from the
placement code, so a load that brings back exactly the reader's own bytes is the check of rules 11 and 12.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry

from kvsidecar.datapath.transfers import DataPath
from kvsidecar.memory.regions import SessionMemory
from kvsidecar.memory.slices import host_tensor
from kvsidecar.metrics import Metrics
from kvsidecar.movers.factory import Movers
from kvsidecar.movers.runtime import GpuRuntime, GpuSettings
from kvsidecar.sessions.session import Session
from kvsidecar.store import Store
from kvsidecar.store.memory_store import MemoryStore
from kvsidecar.values import LoadArgs, LookupArgs, RegionRequest, Role, SaveArgs
from kvsidecar_contract.placement import Geometry, GroupSpec, Hit, Kind, Layout, Parallel
from kvsidecar_testing.states import StateLayer, element

POISON = 0xA5
NUM_BLOCKS = 8
PADDING = 8  # bytes past each state page, as vLLM pads pages to a common size: never part of a value


class Attention(NamedTuple):
    """A full-attention group: K and V per layer, `head_size` fp16 elements per token and KV head, head-major."""

    head_size: int = 4


class Latent(NamedTuple):
    """An MLA group: one latent of `size` fp16 elements per token, the same on every rank."""

    size: int = 6


GroupModel = Attention | Latent | StateLayer


@dataclass(frozen=True)
class Model:
    """What the engines run: groups, layers per group, KV heads of attention, block size (= U)."""

    groups: tuple[GroupModel, ...]
    kv_heads: int = 8
    layers: int = 2
    block: int = 16

    def specs(self) -> tuple[GroupSpec, ...]:
        out = []
        for g in self.groups:
            if isinstance(g, Attention):
                out.append(GroupSpec(Kind.FULL_ATTENTION, self.block))
            elif isinstance(g, Latent):
                out.append(GroupSpec(Kind.MLA, self.block))
            else:
                out.append(GroupSpec(Kind.MAMBA, self.block, state=g.state()))
        return tuple(out)

    def layout(self, tp: int, rank: int = 0, share: int = 0, **kw: object) -> Layout:
        return Layout(
            "org/Hybrid", self.specs(), Parallel(tp_size=tp, tp_rank=rank), self.kv_heads, self.block,
            value_identity="w", share_tp_size=share, **kw,  # type: ignore[arg-type]
        )  # fmt: skip


def heads_of(kv_heads: int, tp: int, rank: int) -> list[int]:
    """vLLM's KV heads of a rank: H/T consecutive ones, or the one head T/H ranks replicate."""
    if kv_heads >= tp:
        per = kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * kv_heads // tp]


class _Mapping:
    def __init__(self, address: int, size: int) -> None:
        self.address, self.size, self.identity, self.device = address, size, ("plain", address), "cpu"

    def tensor(self) -> Any:
        return host_tensor(self.address, self.size)

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Opener:
    """A region's handle is the address of its buffer."""

    def key(self, i: int, handle: object) -> str:
        return str(handle)

    def open(self, handle: object, size: int) -> _Mapping:
        return _Mapping(int(handle), size)  # type: ignore[call-overload]


@dataclass
class _Region:
    group: int
    layer: int
    what: str  # "k", "v", "latent", "state"
    block_bytes: int
    stride: int
    buffer: ctypes.Array[ctypes.c_char] = field(repr=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.buffer = (ctypes.c_char * (self.stride * NUM_BLOCKS))()
        ctypes.memset(self.buffer, POISON, len(self.buffer))

    def write(self, block_id: int, data: bytes) -> None:
        assert len(data) == self.block_bytes
        ctypes.memmove(ctypes.addressof(self.buffer) + block_id * self.stride, data, len(data))

    def read(self, block_id: int) -> bytes:
        start = block_id * self.stride
        return bytes(self.buffer[start : start + self.block_bytes])


class Rank:
    """One engine rank: its session (layout, geometry, memory and its mover over store) and its regions' buffers;
    movers: whose mover the memory gets (default: the host path's, over store)."""

    def __init__(self, model: Model, layout: Layout, store: Store, movers: Movers | None = None) -> None:
        self.model, self.layout = model, layout
        par = layout.parallel
        self.tp, self.rank = par.tp_size, par.tp_rank
        self.regions: list[_Region] = []
        requests = []
        for g, group in enumerate(model.groups):
            for layer in range(model.layers):
                for what in self._parts(group):
                    size = len(self.content(g, layer, what, "0"))
                    stride = size + (PADDING if what == "state" else 0)
                    region = _Region(g, layer, what, size, stride)
                    self.regions.append(region)
                    heads = len(heads_of(model.kv_heads, self.tp, self.rank)) if isinstance(group, Attention) else 0
                    requests.append(
                        RegionRequest(
                            ctypes.addressof(region.buffer), len(region.buffer), 0, stride, size, NUM_BLOCKS, (g,),
                            heads,
                        )  # type: ignore[arg-type]
                    )  # fmt: skip
        cuts = [layout.value_cut(g) for g in range(len(model.groups))]
        memory = SessionMemory(requests, len(model.groups), _Opener(), cuts)
        self.session = Session(
            f"{self.tp}.{self.rank}", Role.RANK, layout, Geometry.of(layout), 32, "test", 0.0, float("inf"), memory
        )
        self.session.mover = (movers or Movers(store)).mover(memory)

    @staticmethod
    def _parts(group: GroupModel) -> tuple[str, ...]:
        if isinstance(group, Attention):
            return ("k", "v")
        return ("latent",) if isinstance(group, Latent) else ("state",)

    def content(self, g: int, layer: int, what: str, prefix: str) -> bytes:
        """The bytes this rank holds in one region's block whose prefix (end boundary's hash) is `prefix`."""
        group, block = self.model.groups[g], self.model.block
        seed = f"g{g}|l{layer}|{what}|{prefix}"
        if isinstance(group, Attention):
            heads = heads_of(self.model.kv_heads, self.tp, self.rank)
            coords = itertools.product(heads, range(block), range(group.head_size))
            return b"".join(element(seed, c, 2) for c in coords)
        if isinstance(group, Latent):
            return b"".join(element(seed, c, 2) for c in itertools.product(range(block), range(group.size)))
        return group.page(seed, self.tp, self.rank)

    def fill(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """The engine after prefilling: block k of every group holds what ends at boundary (k + 1) * block."""
        u = self.model.block
        for region in self.regions:
            for k, block_id in enumerate(block_ids):
                prefix = hashes[(k + 1) * self.model.block // u - 1].hex()
                region.write(block_id, self.content(region.group, region.layer, region.what, prefix))


class Engines:
    """Writers and readers of one model on one store, through the daemon's DataPath: its host path, or (device)
    its GPU path with the CPU standing in for the GPU (staging, gathers and scatters by views)."""

    def __init__(self, model: Model, device: bool = False) -> None:
        self.model, self.device = model, device
        self.store = MemoryStore()
        metrics = Metrics(CollectorRegistry())
        self.runtime = None
        if device:
            # A CPU standing in for the GPU: host memory moves through the device path.
            self.runtime = GpuRuntime(GpuSettings("cpu", 1 << 20, 256 << 10), self.store, metrics)
            self.runtime.start()
        self.movers = Movers(self.store, metrics, self.runtime)
        self.path = DataPath(self.store, metrics)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()

    def ranks(self, tp: int, share: int) -> list[Rank]:
        return [Rank(self.model, self.model.layout(tp, r, share), self.store, self.movers) for r in range(tp)]

    def save(self, ranks: Sequence[Rank], hashes: Sequence[bytes], block_ids: Sequence[int], tokens: int) -> list:
        outcomes = []
        for rank in ranks:
            rank.fill(hashes, block_ids)
            ids = [list(block_ids) for _ in self.model.groups]
            outcomes.append(self.path.save(rank.session, SaveArgs(hashes, ids, tokens)))
        return outcomes

    def lookup(self, rank: Rank, hashes: Sequence[bytes], tokens: int) -> Hit:
        return self.path.lookup(rank.session, LookupArgs(hashes, tokens))

    def load(self, rank: Rank, hashes: Sequence[bytes], block_ids: Sequence[int], hit: Hit) -> list:
        ids = [list(block_ids) for _ in self.model.groups]
        return list(self.path.load(rank.session, LoadArgs(hashes, ids, hit.hit_tokens, hit.tail_boundaries)).failures)

    def expected(self, rank: Rank, hashes: Sequence[bytes], block_ids: Sequence[int], hit: int) -> list[str]:
        """Every region block that differs from what the reader's own rank holds after a hit of `hit` tokens."""
        u, block = self.model.block, self.model.block
        wrong = []
        last = (hit - 1) // block
        for i, region in enumerate(rank.regions):
            needed = range(last, last + 1) if region.what == "state" else range(last + 1)
            for k, block_id in enumerate(block_ids):
                got = region.read(block_id)
                if k in needed:
                    want = rank.content(region.group, region.layer, region.what, hashes[(k + 1) * block // u - 1].hex())
                else:
                    want = bytes([POISON]) * region.block_bytes
                if got != want:
                    wrong.append(f"region {i} (group {region.group} layer {region.layer} {region.what}) block {k}")
        return wrong
