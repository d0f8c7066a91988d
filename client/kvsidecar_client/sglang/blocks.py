"""From host pool pages to the session's block ids: what each group registers, and the ids one call moves.

A pool shared in place (sharing.py) registers its own buffers, one region per page run, and its block ids are its
page indices: the daemon reads and writes the pool itself. A pool that is not registers its runs of the staging
area (staging.py): a save gathers its pages into slots 0..n-1 and names those, a load names slots n..2n-1 and
scatters the ones that loaded into the pool, each direction under its own lock so SGLang's backup and prefetch
threads run side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvsidecar_client.sglang.pages import PagePool
from kvsidecar_client.sglang.staging import Staging, storage_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["PageMemory"]


class PageMemory:
    """The memory of a session's groups, group g serving pools[g]: in place where `direct[g]`, else staged."""

    def __init__(
        self,
        pools: Sequence[tuple[PagePool, Sequence[torch.Tensor]]],
        direct: Sequence[bool],
        staging_pages: int,
    ) -> None:
        self._pools = list(pools)
        self._direct = list(direct)
        staged = [g for g, d in enumerate(direct) if not d]
        # Group -> its index in the staging area.
        self._staged = {g: i for i, g in enumerate(staged)}
        self._slots = staging_pages
        self._staging = Staging([pools[g] for g in staged], 2 * staging_pages) if staged else None
        self._save_lock = threading.Lock()
        self._load_lock = threading.Lock()

    def direct(self, group: int) -> bool:
        """Whether the group's pool is shared in place (zero-copy)."""
        return self._direct[group]

    def capacity(self, group: int) -> int | None:
        """Pages one call of the group may move at once (the staging area's), None for a pool shared in place."""
        return None if self._direct[group] else self._slots

    def tensors(self) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        """What the session registers: each group's regions (dim 0: its block ids), and the group each serves."""
        tensors: list[torch.Tensor] = []
        groups: list[tuple[int, ...]] = []
        for g, (pool, buffers) in enumerate(self._pools):
            if self._direct[g]:
                runs = [
                    storage_bytes(buffers[r.buffer]).as_strided((pool.num_pages, r.size), (r.stride, 1), r.offset)
                    for r in pool.runs
                ]
            else:
                assert self._staging is not None
                runs = self._staging.tensors(self._staged[g])
            tensors += runs
            groups += [(g,)] * len(runs)
        return tensors, groups

    @contextlib.contextmanager
    def saving(self, group: int, pages: torch.Tensor) -> Iterator[list[int]]:
        """The block ids of `pages` for a save, valid until the block exits (staged: copied into save slots)."""
        if self._direct[group]:
            yield pages.tolist()
            return
        assert self._staging is not None
        with self._save_lock:
            self._staging.gather(self._staged[group], pages, 0)
            yield list(range(pages.numel()))

    @contextlib.contextmanager
    def loading(self, group: int, pages: torch.Tensor) -> Iterator[tuple[list[int], Callable[[Sequence[int]], None]]]:
        """The block ids a load of `pages` fills, and what to call with the positions that loaded (staged: copies
        those slots into the pool's pages)."""
        if self._direct[group]:
            yield pages.tolist(), _nothing
            return
        import torch

        assert self._staging is not None
        staging, index, first = self._staging, self._staged[group], self._slots

        def loaded(positions: Sequence[int]) -> None:
            chosen = pages.index_select(0, torch.tensor(list(positions), dtype=torch.int64))
            staging.scatter(index, chosen, [first + i for i in positions])

        with self._load_lock:
            yield [first + i for i in range(pages.numel())], loaded


def _nothing(positions: Sequence[int]) -> None:
    """A pool shared in place already holds what loaded."""
