"""The one seam for bytes: what the data path asks of a session memory's mover, whatever memory it is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvsidecar.memory.regions import SessionMemory
from kvsidecar.metrics import Metrics
from kvsidecar.movers.sums import Loaded
from kvsidecar.store import StoreCode
from kvsidecar.store.base import Pin
from kvsidecar_contract.placement import Chunk

__all__ = ["Mover", "by_pin", "check_chunks", "count_failure"]


class Mover(Protocol):
    """Moves one session memory's values between its blocks and the store; chosen once, when the memory is
    registered (movers/factory.py). A stored value is a chunk's block's slices, concatenated (memory/regions.py),
    and, where its key is chosen, a checksum trailer (trailer.py) sealed from the bytes put and checked before a
    load answers (sums.py)."""

    memory: SessionMemory

    def check(self, chunks: Sequence[Chunk]) -> None:
        """Raise BadRequest unless every chunk names a block (and value part) of the memory: before anything moves."""

    def put(
        self, keys: Sequence[str], chunks: Sequence[Chunk], pins: Sequence[Pin | None] | None = None
    ) -> list[StoreCode]:
        """Write each checked chunk's value under its key, kept as pins says (per chunk; None: all ordinary cache);
        one code per chunk (a store call that failed whole gives its code to each of its chunks). Returns once the
        blocks may be reused."""
        ...

    def get(self, keys: Sequence[str], chunks: Sequence[Chunk]) -> list[Loaded]:
        """Read each key's value into its checked chunk's block; one code per chunk, CHECKSUM_MISMATCH for a value
        whose bytes fail their trailer (removed from the store). A value that was not read is never written into its
        block; returns once the bytes are in the engine's memory."""
        ...

    def close(self) -> None:
        """Let go of the memory (what the mover registered for it, views into it): no call runs on it any more."""


def check_chunks(memory: SessionMemory, chunks: Sequence[Chunk]) -> None:
    """Raise BadRequest unless every chunk names a block (and value part) of memory."""
    check = memory.check
    for c in chunks:
        check(c.group, c.block_id, c.part)


def count_failure(metrics: Metrics, operation: str, code: StoreCode) -> None:
    """A store call that failed as a whole, counted for operators."""
    metrics.store_errors.labels(operation, code.value).inc()


def by_pin(pins: Sequence[Pin | None] | None, members: Sequence[int]) -> list[tuple[Pin | None, list[int]]]:
    """members grouped by the pin each asks for, in order of first appearance: one batch put per pin."""
    if pins is None:
        return [(None, list(members))]
    groups: dict[Pin | None, list[int]] = {}
    for m in members:
        groups.setdefault(pins[m], []).append(m)
    return list(groups.items())
