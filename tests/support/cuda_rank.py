"""An engine rank whose KV cache is CUDA memory laid out as vLLM 0.33 allocates it (one buffer per group, every
layer a view of it), in a process of its own (kvsidecar_testing.ranks drives it), talking to a real daemon.

Every block holds bytes that say which group, layer and block they were written for (`pattern`), so a rank of
another process can check a loaded block against the block it was saved from, on the GPU.

On a machine without a GPU, DEVICE is "cpu" and the same layout lives in shared memory: with a daemon standing a
CPU in for its GPU (--gpu cpu), it moves through the daemon's device mover all the same (tests/gpu in the suite).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

BLOCK_TOKENS = 16
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


def pattern(group: int, layers: int, blocks: int, slice_bytes: int, seed: int, device: str = DEVICE) -> Any:
    """The bytes every block of one group holds after `fill(seed)`: [layers, blocks, slice_bytes / 8] int64."""
    words = slice_bytes // 8
    out = torch.arange(layers * blocks * words, dtype=torch.int64, device=device).view(layers, blocks, words)
    return out.add_(((seed * 7919 + group) << 40) + (1 << 62))


class CudaRank:
    """One rank: `groups` = [(kind, layers, slice_bytes)], `blocks` per layer (a big KV cache is many blocks)."""

    def __init__(
        self,
        target: str,
        model: str,
        groups: Sequence[tuple[str, int, int]],
        blocks: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        kv_heads: int = 8,
    ) -> None:
        from kvsidecar_client import EngineLayout, GroupSpec, SidecarClient

        self.torch = torch
        self.groups = list(groups)
        self.blocks = blocks
        started = time.perf_counter()
        if DEVICE == "cpu":
            from kvsidecar_client import shared_tensor

            self.buffers = [shared_tensor(n * blocks * size, torch.uint8) for _, n, size in groups]
        else:
            torch.cuda.init()
            torch.empty(1, device=DEVICE)
            self.buffers = [torch.empty(n * blocks * size, dtype=torch.uint8, device=DEVICE) for _, n, size in groups]
        self.cuda_start_s = time.perf_counter() - started
        self.client = SidecarClient.connect(
            target,
            model=model,
            layout=EngineLayout(tp_size=tp_size, tp_rank=tp_rank),
            num_kv_heads=kv_heads,
            hash_block_size=BLOCK_TOKENS,
            groups=[GroupSpec(kind, BLOCK_TOKENS) for kind, _, _ in groups],
            client_name="gpu-check",
        )

    def ready(self) -> dict[str, float]:
        return {"cuda_start_s": self.cuda_start_s}

    def _layers(self, g: int) -> list[Any]:
        _, layers, size = self.groups[g]
        return list(self.buffers[g].view(layers, self.blocks, size).unbind(0))

    def register(self) -> float:
        """Register every layer of every group; seconds the call took."""
        tensors, owners = [], []
        for g in range(len(self.groups)):
            for layer in self._layers(g):
                tensors.append(layer)
                owners.append((g,))
        started = time.perf_counter()
        self.client.register(tensors, owners)
        return time.perf_counter() - started

    def fill(self, seed: int) -> None:
        for g, (_, layers, size) in enumerate(self.groups):
            self.buffers[g].view(self.torch.int64).copy_(pattern(g, layers, self.blocks, size, seed).view(-1))
        if DEVICE != "cpu":
            self.torch.cuda.synchronize()

    def save(self, hashes: list[bytes], ids: list[list[int]], tokens: int) -> dict[str, Any]:
        started = time.perf_counter()
        result = self.client.save(hashes, ids, tokens).result()
        return {"seconds": time.perf_counter() - started, "written": result.written, "failed": result.failed}

    def lookup(self, hashes: list[bytes], tokens: int) -> tuple[int, tuple[int, ...]]:
        hit = self.client.lookup(hashes, tokens)
        return hit.hit_tokens, tuple(hit.tail_boundaries)

    def load(self, hashes: list[bytes], ids: list[list[int]], hit_tokens: int, tails: Sequence[int]) -> dict[str, Any]:
        from kvsidecar_client import Hit

        started = time.perf_counter()
        result = self.client.load_detailed(hashes, ids, Hit(hit_tokens, tuple(tails)))
        seconds = time.perf_counter() - started
        failed = sorted((f.group, f.block_id) for f in result.failures)
        return {"seconds": seconds, "loaded": result.loaded, "failed": failed}

    def matches(self, group: int, pairs: list[tuple[int, int]], seed: int) -> list[tuple[int, int]]:
        """The (destination, source) pairs whose destination block does NOT hold source's bytes of fill(seed)."""
        _, layers, size = self.groups[group]
        expected = pattern(group, layers, self.blocks, size, seed)
        here = self.buffers[group].view(self.torch.int64).view(layers, self.blocks, size // 8)
        return [(d, s) for d, s in pairs if not self.torch.equal(here[:, d], expected[:, s])]

    def exit(self) -> None:
        self.client.close()
