"""Evictions made visible: the most recently announced values, looked up again in turns, without a lease.

Mooncake 0.3.13 evicts (and offloads to disk) inside its master and tells no client. Its existence check takes a
read lease that keeps a key from eviction for the lease TTL, so probing with it would change what the store keeps;
its replica query (`tiers`: memory, disk or absent, one metadata call) takes none. The sweep keeps the `capacity`
most recently announced values and asks where `per_pass` of them are at each pass, oldest first. A value found gone
is announced removed; one moved from memory to disk is announced removed from CPU and stored in STORAGE.

Staleness: a tracked value's eviction is published within ceil(tracked / per_pass) passes (with the defaults, 64 Ki
values and 8 Ki per one-second pass: 8 s, plus the publisher's latency). Values older than the `capacity` most recent
announcements are no longer watched: their eviction is never announced, so a router ages its entries out (a TTL of
minutes), as it must anyway for a node that dies. See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvsidecar.errors import StoreError
from kvsidecar.events.blocks import GroupInfo, StoredBlock
from kvsidecar.events.messages import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from kvsidecar.events.publisher import Event

__all__ = ["DEFAULT_PER_PASS", "DEFAULT_SWEEP_INTERVAL_S", "DEFAULT_TRACKED", "EvictionSweep"]

log = logging.getLogger(__name__)

DEFAULT_TRACKED = 65_536
DEFAULT_PER_PASS = 8_192
DEFAULT_SWEEP_INTERVAL_S = 1.0
_MEDIUM_OF_TIER = {"memory": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


class _Watched:
    """A tracked value: what was announced about it, and where."""

    __slots__ = ("block", "info", "topic")

    def __init__(self, topic: str, block: StoredBlock, info: GroupInfo) -> None:
        self.topic = topic
        self.block = block
        self.info = info


class EvictionSweep:
    """Watches announced values and publishes their removal (or move to disk) when the store no longer has them."""

    def __init__(
        self,
        where: Callable[[Sequence[str]], list[str]],
        publish: Callable[[str, Sequence[Event]], None],
        *,
        capacity: int = DEFAULT_TRACKED,
        per_pass: int = DEFAULT_PER_PASS,
    ) -> None:
        """where: each key's tier now ("memory", "disk" or "" for gone), taking no lease; publish(topic, events)."""
        self._where = where
        self._publish = publish
        self._capacity = capacity
        self._per_pass = per_pass
        self._lock = threading.Lock()
        self._watched: OrderedDict[str, _Watched] = OrderedDict()  # oldest look first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._watched)

    def track(self, topic: str, blocks: Iterable[StoredBlock], groups: Sequence[GroupInfo]) -> None:
        """Watch announced values; past capacity the oldest announcements are no longer watched."""
        with self._lock:
            for b in blocks:
                self._watched[b.key] = _Watched(topic, b, groups[b.group])
                self._watched.move_to_end(b.key)
            while len(self._watched) > self._capacity:
                self._watched.popitem(last=False)

    def forget_prefix(self, prefix: str) -> None:
        """Stop watching every key under prefix (a reset removed them and announced it)."""
        with self._lock:
            for key in [k for k in self._watched if k.startswith(prefix)]:
                del self._watched[key]

    def sweep_once(self) -> int:
        """Look up the next per_pass watched values; publish what changed. Returns the values found changed."""
        with self._lock:
            batch = []
            for key in self._watched:
                batch.append(key)
                if len(batch) == self._per_pass:
                    break
            # Looked at: to the back of the line (the next pass starts with the ones not looked at longest).
            for key in batch:
                self._watched.move_to_end(key)
        if not batch:
            return 0
        try:
            tiers = self._where(batch)
        except StoreError as exc:  # the master is down: nothing is learned this pass, nothing is announced
            log.debug("kv events sweep: cannot ask where values are: %s", exc)
            return 0
        changed: dict[str, list[Event]] = {}
        count = 0
        with self._lock:
            for key, tier in zip(batch, tiers, strict=True):
                watched = self._watched.get(key)
                if watched is None:  # forgotten meanwhile (a reset)
                    continue
                medium = _MEDIUM_OF_TIER.get(tier)
                block = watched.block
                if medium == block.medium:
                    continue
                count += 1
                events = changed.setdefault(watched.topic, [])
                events.append(BlockRemoved(block_hashes=[block.block_hash], medium=block.medium, group_idx=block.group))
                if medium is None:
                    del self._watched[key]
                    continue
                watched.block = block._replace(medium=medium)
                events.append(_stored(watched.block, watched.info))
        for topic, events in changed.items():
            self._publish(topic, events)
        return count

    def start(self, interval: float = DEFAULT_SWEEP_INTERVAL_S) -> None:
        """Sweep every interval seconds in a thread of its own."""
        self._thread = threading.Thread(target=self._run, args=(interval,), name="kv-events-sweep", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sweep_once()


def _stored(block: StoredBlock, info: GroupInfo) -> BlockStored:
    """A value announced again in a new medium (its tokens and parent were announced with its first store)."""
    return BlockStored(
        block_hashes=[block.block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=info.span,
        lora_id=None,
        medium=block.medium,
        lora_name=None,
        group_idx=block.group,
        kv_cache_spec_kind=info.kind,
        kv_cache_spec_sliding_window=info.window,
    )
