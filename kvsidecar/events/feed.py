"""What the data path tells routers: values stored by a save, and a reset's clearing, on the tenant's topic.

The data path calls a `StoreEvents` after the store answered; `EventFeed` turns that into vLLM's events on
`<topic>.<tenant>` (just `<topic>` for a daemon without a tenants file) and hands them to the sweep to watch.
`NO_EVENTS` is the feed of a daemon without --kv-events-endpoint: it does nothing, at no cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvsidecar.events.blocks import groups_of, stored_events
from kvsidecar.events.messages import MEDIUM_CPU, AllBlocksCleared
from kvsidecar.events.publisher import Event
from kvsidecar.events.sweep import EvictionSweep
from kvsidecar_contract.placement import Chunk, Geometry

__all__ = ["NO_EVENTS", "EventFeed", "NoEvents", "StoreEvents", "topic_for"]


def topic_for(base: str, tenant: str) -> str:
    """A tenant's topic: `<base>.<tenant>`, or the base topic for the single tenant of a daemon without tenants."""
    return f"{base}.{tenant}" if tenant else base


class StoreEvents(Protocol):
    """The data path's report of what changed in the store."""

    def stored(
        self,
        tenant: str,
        geometry: Geometry,
        hashes: Sequence[bytes],
        written: Sequence[Chunk],
        tokens: Sequence[int],
        tokens_start: int,
    ) -> None:
        """Values a save wrote (only those: not the ones already stored, nor failed ones)."""

    def cleared(self, tenant: str, key_prefix: str) -> None:
        """A reset removed every value under key_prefix."""


class NoEvents:
    """No publisher configured."""

    def stored(
        self,
        tenant: str,
        geometry: Geometry,
        hashes: Sequence[bytes],
        written: Sequence[Chunk],
        tokens: Sequence[int],
        tokens_start: int,
    ) -> None:
        return

    def cleared(self, tenant: str, key_prefix: str) -> None:
        return


NO_EVENTS = NoEvents()


class EventFeed:
    """StoreEvents published with `publish(topic, events)` and watched by an optional eviction sweep."""

    def __init__(
        self, publish: Callable[[str, Sequence[Event]], None], topic: str, sweep: EvictionSweep | None = None
    ) -> None:
        self._publish = publish
        self._topic = topic
        self._sweep = sweep

    def stored(
        self,
        tenant: str,
        geometry: Geometry,
        hashes: Sequence[bytes],
        written: Sequence[Chunk],
        tokens: Sequence[int],
        tokens_start: int,
    ) -> None:
        if not written:
            return
        groups = groups_of(geometry)
        topic = topic_for(self._topic, tenant)
        u = geometry.layout.hash_block_size
        # Saves write into the DRAM pool; a disk tier only ever receives what DRAM evicts (the sweep sees it).
        events, blocks = stored_events(groups, u, hashes, written, MEDIUM_CPU, tokens, tokens_start)
        self._publish(topic, events)
        if self._sweep is not None:
            self._sweep.track(topic, blocks, groups)

    def cleared(self, tenant: str, key_prefix: str) -> None:
        if self._sweep is not None:
            self._sweep.forget_prefix(key_prefix)
        self._publish(topic_for(self._topic, tenant), [AllBlocksCleared()])
