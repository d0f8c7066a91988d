"""What the bench moves: model KV-cache shapes, engine memory laid out like vLLM's, requests and their keys."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvsidecar_contract.placement import Chunk, Geometry, Layout, Parallel, load_plan, parse_groups, save_plan
from kvsidecar_testing.hashes import chained_hashes

if TYPE_CHECKING:
    import torch

__all__ = [
    "GQA",
    "GQA_TP8",
    "MLA",
    "SHAPES",
    "EngineMemory",
    "ModelShape",
    "Request",
    "hashes_for",
    "scale_rank_shape",
]

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class ModelShape:
    """One model's KV cache as an engine rank holds it: one tensor per layer and K/V, dim 0 = blocks."""

    name: str
    title: str
    group: str  # the session's KV-cache group kind
    layers: int
    tensors_per_layer: int  # 1: an MLA latent; 2: separate K and V tensors
    token_dims: tuple[int, ...]  # per token, per tensor (bf16 values)
    kv_heads: int = 1  # H of the session (only full_attention cares)
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def regions(self) -> int:
        """Tensors a stored value is gathered from (its slices, in registration order)."""
        return self.layers * self.tensors_per_layer

    @property
    def slice_bytes(self) -> int:
        """Bytes of one block in one tensor."""
        return BLOCK_TOKENS * math.prod(self.token_dims) * 2

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value (one block across every tensor)."""
        return self.regions * self.slice_bytes

    def layout(self, model: str, cache_prefix: str = "") -> Layout:
        """The placement layout the daemon derives for this rank."""
        return Layout(
            model,
            parse_groups(self.group, BLOCK_TOKENS),
            Parallel(tp_size=self.tp_size, tp_rank=self.tp_rank),
            self.kv_heads,
            BLOCK_TOKENS,
            cache_prefix,
        )

    def describe(self) -> str:
        """One line for the report."""
        mib = self.value_bytes / 2**20
        return f"{self.title}; {self.regions} slices of {self.slice_bytes // 1024} KiB = {mib:.2f} MiB per block"


MLA = ModelShape(
    name="mla",
    title="MLA (DeepSeek-V3-like): 61 layers x 576 bf16 per token, one latent tensor per layer, 16-token blocks",
    group="mla",
    layers=61,
    tensors_per_layer=1,
    token_dims=(576,),
)
GQA = ModelShape(
    name="gqa",
    title="GQA (Llama-3.1-8B-like): 32 layers x 8 KV heads x 128 bf16, K and V tensors per layer, 16-token blocks",
    group="full_attention",
    layers=32,
    tensors_per_layer=2,
    token_dims=(8, 128),
    kv_heads=8,
)


def scale_rank_shape(rank: int) -> ModelShape:
    """Rank `rank` of a TP-8 GQA engine with 8 KV heads: one head per rank, every rank its own shard."""
    return dataclasses.replace(
        GQA,
        name="gqa-tp8",
        title="GQA at TP=8 (Llama-3.1-8B-like), rank 0: 32 layers x 1 KV head x 128 bf16, K and V tensors per layer",
        token_dims=(1, 128),
        tp_size=8,
        tp_rank=rank,
    )


GQA_TP8 = scale_rank_shape(0)
SHAPES = {shape.name: shape for shape in (MLA, GQA, GQA_TP8)}


def hashes_for(tag: str, count: int) -> list[bytes]:
    """Chained 32-byte block hashes, distinct per tag (as an engine's prefix hashes are per prompt)."""
    return chained_hashes(tag, count)


class Request(NamedTuple):
    """One request's blocks: saved from block ids `save_ids`, loaded back into `load_ids` (other physical blocks)."""

    hashes: list[bytes]
    num_tokens: int
    save_ids: list[int]
    load_ids: list[int]
    nbytes: int  # bytes of KV this request moves each way

    @classmethod
    def of(cls, shape: ModelShape, tag: str, blocks: int, load_offset: int) -> Request:
        """`blocks` full blocks; one extra token so that a lookup can hit every block (the last token is recomputed)."""
        return cls(
            hashes_for(tag, blocks),
            blocks * BLOCK_TOKENS + 1,
            list(range(blocks)),
            list(range(load_offset, load_offset + blocks)),
            blocks * shape.value_bytes,
        )

    def save_chunks(self, geo: Geometry) -> tuple[Chunk, ...]:
        """The chunks this rank writes, with their keys (the daemon's own placement code)."""
        return save_plan(geo, self.hashes, [self.save_ids], self.num_tokens).chunks

    def load_chunks(self, geo: Geometry) -> tuple[Chunk, ...]:
        """The chunks a full hit reads into `load_ids`."""
        hit = len(self.hashes) * BLOCK_TOKENS
        return load_plan(geo, self.hashes, [self.load_ids], hit, [hit])


class EngineMemory:
    """A rank's KV-cache tensors, filled with a per-rank byte pattern; the daemon maps them, Mooncake reads them.

    `tensors` are any tensors whose dim 0 indexes blocks (shared memory for the daemon path, a Mooncake memory pool
    for the real-client path, cuda:0 for `--device cuda`); every address the bench hands to a store comes from
    `addresses`.
    """

    def __init__(self, shape: ModelShape, tensors: Sequence[torch.Tensor]) -> None:
        self.shape = shape
        self.tensors = list(tensors)
        self.bases = [int(t.data_ptr()) for t in self.tensors]
        self.num_blocks = int(self.tensors[0].shape[0])
        self.sizes = [shape.slice_bytes] * len(self.tensors)

    @classmethod
    def shared(cls, shape: ModelShape, num_blocks: int, seed: int = 0) -> EngineMemory:
        """Tensors in shared memory the daemon can map (kvsidecar_client.shared_tensor), laid out as vLLM's CPU
        worker allocates its KV cache: one allocation (one memfd), every layer a view of it, layer after layer."""
        import torch

        from kvsidecar_client import shared_tensor

        whole = shared_tensor((shape.regions, num_blocks, BLOCK_TOKENS, *shape.token_dims), torch.bfloat16)
        tensors = list(whole.unbind(0))
        memory = cls(shape, tensors)
        memory.fill(seed)
        return memory

    @classmethod
    def allocate(cls, shape: ModelShape, num_blocks: int, seed: int, device: str) -> EngineMemory:
        """Tensors the daemon can map on `device`: shared memory (cpu) or caching-allocator memory on cuda:0, which
        the client describes to the daemon as CUDA IPC handles (as vLLM's KV cache)."""
        if device == "cpu":
            return cls.shared(shape, num_blocks, seed)
        import torch

        # As vLLM 0.33 allocates a KV cache: one buffer, every layer (K and V) a view of it, layer after layer.
        whole = torch.empty(shape.regions * num_blocks * shape.slice_bytes, dtype=torch.uint8, device="cuda:0")
        tensors = list(whole.view(shape.regions, num_blocks, shape.slice_bytes).unbind(0))
        memory = cls(shape, tensors)
        memory.fill(seed)
        torch.cuda.synchronize()  # the fill is queued on the stream; the daemon's Mooncake reads the memory directly
        return memory

    @property
    def device(self) -> str:
        """`cpu` or `cuda`: where the tensors live."""
        return str(self.tensors[0].device.type)

    @classmethod
    def at(cls, shape: ModelShape, num_blocks: int, address: int) -> EngineMemory:
        """Tensors over raw memory at `address` (e.g. a Mooncake memory pool), region after region."""
        import ctypes

        import torch

        size = num_blocks * shape.slice_bytes
        tensors = []
        for r in range(shape.regions):
            raw = (ctypes.c_uint8 * size).from_address(address + r * size)
            tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(num_blocks, shape.slice_bytes))
        return cls(shape, tensors)

    @staticmethod
    def bytes_needed(shape: ModelShape, num_blocks: int) -> int:
        """Bytes `at` uses."""
        return shape.regions * num_blocks * shape.slice_bytes

    def fill(self, seed: int) -> None:
        """Distinct bytes per block and per tensor, so a misplaced slice cannot go unnoticed (touches every page)."""
        import torch

        for r, tensor in enumerate(self.tensors):
            words = tensor.view(torch.int64).view(-1)
            torch.arange(words.numel(), out=words)
            words.add_((seed * 7919 + r) << 40)

    def copy_from(self, other: EngineMemory) -> None:
        """The same bytes as `other` (same shape and block count)."""
        import torch

        for mine, theirs in zip(self.tensors, other.tensors, strict=True):
            mine.view(torch.uint8).view(-1).copy_(theirs.view(torch.uint8).view(-1))

    def blocks_view(self) -> torch.Tensor:
        """[blocks, regions, slice bytes / 8] over the memory, when its regions are one buffer layer after layer (as
        `allocate` lays out GPU memory): what one gather kernel reads and one scatter kernel writes."""
        import torch

        first, n, size = self.tensors[0], self.num_blocks, self.shape.slice_bytes
        step = self.bases[1] - self.bases[0] if len(self.bases) > 1 else n * size
        if any(b - self.bases[0] != r * step for r, b in enumerate(self.bases)) or step != n * size:
            raise ValueError("the regions are not one buffer, layer after layer")
        return torch.as_strided(first.view(torch.int64), (n, self.shape.regions, size // 8), (size // 8, step // 8, 1))

    def addresses(self, block_id: int) -> list[int]:
        """Where block `block_id`'s slices live, in registration order."""
        stride = self.shape.slice_bytes
        return [base + block_id * stride for base in self.bases]

    def clear_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero some blocks (so a load that moved nothing is caught by `same_blocks`)."""
        for tensor in self.tensors:
            tensor[block_ids[0] : block_ids[-1] + 1].zero_()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()  # zeroed before a store (another process, or Mooncake's copy) writes them

    def same_blocks(self, a: Sequence[int], b: Sequence[int]) -> bool:
        """Whether blocks `a` and `b` (contiguous runs) hold the same bytes in every tensor (compared on its device)."""
        import torch

        return all(
            torch.equal(t[a[0] : a[-1] + 1].view(torch.uint8), t[b[0] : b[-1] + 1].view(torch.uint8))
            for t in self.tensors
        )

    def buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of every tensor: what a store registers once per rank (vLLM's connector does; RDMA
        needs it)."""
        return [(base, t.numel() * t.element_size()) for base, t in zip(self.bases, self.tensors, strict=True)]
