"""The daemon's KV-event publishing, whole: the publisher, the feed the data path calls, and the eviction sweep."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from kvsidecar.events.endpoints import who_may_connect
from kvsidecar.events.feed import EventFeed
from kvsidecar.events.publisher import Publisher
from kvsidecar.events.sweep import DEFAULT_SWEEP_INTERVAL_S, EvictionSweep

__all__ = ["NodeEvents"]


class NodeEvents:
    """Publishes this node's store changes on `endpoint`; `where` (a lease-free tier query) enables the sweep."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        topic: str,
        registry: CollectorRegistry,
        where: Callable[[Sequence[str]], list[str]] | None = None,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL_S,
    ) -> None:
        self.publisher = Publisher(endpoint, replay_endpoint, base_topic=topic, registry=registry)
        self.sweep = EvictionSweep(where, self.publisher.publish) if where is not None else None
        self.feed = EventFeed(self.publisher.publish, topic, self.sweep)
        self._sweep_interval = sweep_interval

    def start(self) -> None:
        """Bind and start publishing (PublisherError if an endpoint cannot be bound), then start the sweep."""
        self.publisher.start()
        if self.sweep is not None:
            self.sweep.start(self._sweep_interval)

    def listeners(self) -> list[tuple[str, str, str]]:
        """(role, address, who may connect) of each bound socket, for the daemon's listener report."""
        out = [("kv-events", self.publisher.address, who_may_connect(self.publisher.address))]
        if self.publisher.replay_address:
            address = self.publisher.replay_address
            out.append(("kv-events-replay", address, who_may_connect(address)))
        return out

    def stop(self) -> None:
        """Stop the sweep, send what is queued, close the sockets."""
        if self.sweep is not None:
            self.sweep.stop()
        self.publisher.stop()
