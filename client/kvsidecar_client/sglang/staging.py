"""Sealed shared memory SGLang's pages pass through on their way to and from the daemon, where a pool cannot be
shared in place.

A host pool the daemon can map is moved into a sealed memfd in place (sharing.py) and moves zero-copy. One that
cannot be (pinned by a driver, hugetlb pages, another library's allocator, or `zero_copy: false`) is copied through
a staging area of the rank's own in a sealed memfd (`shared_tensor`), which it registers once: a call's pages are
copied into it (saves) or out of it (loads), one memcpy per page each way, in SGLang's storage threads, never in a
forward pass (docs/sglang.md says what it costs).

The area is run-major: run r of every slot is one dense array, so a call's pages move with one gather or scatter
per run, whatever the number of pages. Copies go through the widest integer view the run's offsets and sizes allow:
torch copies rows of bytes element by element, and at 8 bytes an element it runs at memcpy speed (5 GiB/s here, 0.7
for uint8 rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvsidecar_client.memory import shared_tensor
from kvsidecar_client.sglang.pages import PagePool

if TYPE_CHECKING:
    import torch

__all__ = ["Staging", "storage_bytes"]


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Every byte of a tensor's storage as a flat uint8 tensor (the runs' offsets count from its first byte)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


class Staging:
    """`slots` pages of every pool it serves, in one sealed memfd; slot s is block id s of each pool's group."""

    def __init__(self, pools: Sequence[tuple[PagePool, Sequence[torch.Tensor]]], slots: int) -> None:
        """pools: each pool's pages and its buffers (`pages.pool_buffers`), in group order."""
        import torch

        self.slots = slots
        total = slots * sum(pool.page_bytes for pool, _ in pools)
        self._memory = shared_tensor((total,), torch.uint8)
        # Per pool, per run: this area's (slots, size) bytes (registered), and the same run of this area and of the
        # pool's (pages, size) in the widest integer elements they allow (copied through).
        self._registered: list[list[torch.Tensor]] = []
        self._runs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        start = 0
        for pool, buffers in pools:
            registered, runs = [], []
            for run in pool.runs:
                flat = storage_bytes(buffers[run.buffer])
                unit = next(u for u in (8, 4, 2, 1) if not (run.offset | run.stride | run.size | start) % u)
                dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[unit]
                mine = self._memory[start : start + slots * run.size]
                registered.append(mine.view(slots, run.size))
                wide = flat[: flat.numel() - flat.numel() % unit].view(dtype)
                theirs = wide.as_strided(
                    (pool.num_pages, run.size // unit), (run.stride // unit, 1), run.offset // unit
                )
                runs.append((mine.view(dtype).view(slots, run.size // unit), theirs))
                start += slots * run.size
            self._registered.append(registered)
            self._runs.append(runs)

    def tensors(self, pool: int) -> list[torch.Tensor]:
        """What to register for pool `pool` (its index in `pools`): every run (dim 0: the slots)."""
        return list(self._registered[pool])

    def gather(self, pool: int, pages: torch.Tensor, first: int) -> None:
        """Copy the pool's pages into slots first, first + 1, ... (before a save)."""
        import torch

        count = pages.numel()
        for mine, theirs in self._runs[pool]:
            torch.index_select(theirs, 0, pages, out=mine[first : first + count])

    def scatter(self, pool: int, pages: torch.Tensor, slots: Sequence[int]) -> None:
        """Copy slot slots[i] into the pool's page pages[i] (after a load), for the pages that loaded."""
        import torch

        if not slots:
            return
        together = list(slots) == list(range(slots[0], slots[0] + len(slots)))
        index = torch.tensor(slots, dtype=torch.int64)
        for mine, theirs in self._runs[pool]:
            rows = mine[slots[0] : slots[0] + len(slots)] if together else mine.index_select(0, index)
            theirs.index_copy_(0, pages, rows)
