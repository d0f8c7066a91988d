"""The eviction sweep: watched values found gone are announced removed, moved ones removed and stored again."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from kvsidecar.events.blocks import GroupInfo, StoredBlock
from kvsidecar.events.messages import MEDIUM_CPU, MEDIUM_STORAGE
from kvsidecar.events.publisher import Event
from kvsidecar.events.sweep import EvictionSweep
from kvsidecar.store import Presence, StoreCode
from kvsidecar.store.memory_store import MemoryStore

GROUPS = [GroupInfo(16, "full_attention", None)]


class Published:
    def __init__(self) -> None:
        self.items: list[tuple[str, Event]] = []

    def __call__(self, topic: str, events: Sequence[Event]) -> None:
        self.items.extend((topic, e) for e in events)

    def kinds(self) -> list[tuple[str, str, object]]:
        return [(t, type(e).__name__, getattr(e, "medium", None)) for t, e in self.items]


def block(key: str) -> StoredBlock:
    return StoredBlock(key, 0, key.encode(), MEDIUM_CPU)


def memory_tiers(store: MemoryStore):
    """The in-memory store's answer to `where`: memory while it holds a key, gone after."""
    return lambda keys: ["memory" if p is Presence.PRESENT else "" for p in store.exists(keys)]


def test_a_value_the_store_lost_is_announced_removed_once_on_its_topic():
    store = MemoryStore()
    value = ctypes.create_string_buffer(b"v" * 8, 8)
    at = [[ctypes.addressof(value)]] * 2
    assert store.put_from(["a", "b"], at, [[8]] * 2) == [StoreCode.OK, StoreCode.OK]
    published = Published()
    sweep = EvictionSweep(memory_tiers(store), published)
    sweep.track("kv.t", [block("a"), block("b")], GROUPS)
    assert sweep.sweep_once() == 0
    store.remove(["a"])
    assert sweep.sweep_once() == 1
    assert published.kinds() == [("kv.t", "BlockRemoved", MEDIUM_CPU)]
    assert published.items[0][1].block_hashes == [b"a"]
    assert sweep.sweep_once() == 0  # no longer watched
    assert len(sweep) == 1


def test_a_pass_looks_at_per_pass_values_oldest_first_and_all_of_them_in_turn():
    asked: list[list[str]] = []

    def where(keys: Sequence[str]) -> list[str]:
        asked.append(list(keys))
        return ["memory"] * len(keys)

    sweep = EvictionSweep(where, Published(), per_pass=2, capacity=3)
    sweep.track("kv", [block(k) for k in "wxyz"], GROUPS)  # capacity 3: w is no longer watched
    for _ in range(3):
        sweep.sweep_once()
    assert asked == [["x", "y"], ["z", "x"], ["y", "z"]]


def test_a_value_moved_to_disk_is_removed_from_cpu_and_stored_in_storage():
    where = {"a": "disk"}
    published = Published()
    sweep = EvictionSweep(lambda keys: [where[k] for k in keys], published)
    sweep.track("kv", [block("a")], GROUPS)
    assert sweep.sweep_once() == 1
    assert published.kinds() == [("kv", "BlockRemoved", MEDIUM_CPU), ("kv", "BlockStored", MEDIUM_STORAGE)]
    assert sweep.sweep_once() == 0


def test_a_reset_prefix_is_no_longer_watched():
    sweep = EvictionSweep(lambda keys: [""] * len(keys), Published())
    sweep.track("kv", [block("m/p/1"), block("m/q/1")], GROUPS)
    sweep.forget_prefix("m/p/")
    assert len(sweep) == 1
