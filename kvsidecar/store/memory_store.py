"""An in-memory Store for tests: same contract as Mooncake, bytes kept in a dict. Never the daemon's default."""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Callable, Collection, Iterable, Sequence

from kvsidecar.errors import StoreError
from kvsidecar.store.base import Pin, Presence, Replica, StoreHealth, StoreUnavailable, check_batch_shapes
from kvsidecar.store.codes import StoreCode, presence_of_failure

__all__ = ["OPERATIONS", "Fault", "MemoryStore", "Operation"]

Operation = str  # "exists", "put", "get" or "pin"
OPERATIONS = frozenset({"exists", "put", "get", "pin"})
# Decides, per operation and key, a code to force instead of doing the work (None: do it). It may also raise
# StoreError / StoreUnavailable to fail the whole call, as an unreachable master would.
Fault = Callable[[Operation, str], StoreCode | None]


class MemoryStore:
    """A thread-safe dict of values with Mooncake's semantics: put keeps an existing value (and its pin), get checks
    sizes, a value's pin changes only through `pin`. Nothing is evicted: a full store refuses puts (NO_SPACE)."""

    def __init__(self, capacity_bytes: int | None = None, *, require_registration: bool = False) -> None:
        """capacity_bytes makes puts beyond it fail with NO_SPACE; require_registration rejects unregistered memory."""
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._require_registration = require_registration
        self._lock = threading.Lock()
        self._values: dict[str, bytes] = {}
        self._pins: dict[str, Pin] = {}  # the pin each pinned value was given (a soft pin's time is not kept)
        self._used = 0
        self._registered: dict[int, int] = {}
        self._fault: Fault | None = None
        self._closed = False
        self._health_note = ""

    # Fault injection.

    def set_fault(self, fault: Fault | None) -> None:
        """Install (or clear with None) a hook consulted for every key of every exists/put/get."""
        with self._lock:
            self._fault = fault

    def fail_keys(self, code: StoreCode, keys: Collection[str], operations: Collection[Operation] = OPERATIONS) -> None:
        """Make the given operations on the given keys fail with code until set_fault(None)."""
        unknown = set(operations) - OPERATIONS
        if unknown:
            raise ValueError(f"unknown operations {sorted(unknown)}; expected some of {sorted(OPERATIONS)}")
        targets, ops = frozenset(keys), frozenset(operations)
        self.set_fault(lambda op, key: code if op in ops and key in targets else None)

    def fail_next(self, code: StoreCode, count: int = 1, operations: Collection[Operation] = OPERATIONS) -> None:
        """Make the next count per-key operations of the given kinds fail with code, then behave again."""
        remaining = [count]

        def fault(op: Operation, key: str) -> StoreCode | None:
            if op not in operations or remaining[0] <= 0:
                return None
            remaining[0] -= 1
            return code

        self.set_fault(fault)

    # Inspection, for assertions in tests.

    def value(self, key: str) -> bytes | None:
        """The bytes stored under key, or None."""
        with self._lock:
            return self._values.get(key)

    def pin_of(self, key: str) -> Pin | None:
        """The pin key's value was last given (None: ordinary cache, or no value)."""
        with self._lock:
            return self._pins.get(key)

    def keys(self) -> list[str]:
        """All stored keys, sorted."""
        with self._lock:
            return sorted(self._values)

    @property
    def used_bytes(self) -> int:
        """Total size of the stored values."""
        with self._lock:
            return self._used

    # The Store protocol.

    def register_buffer(self, address: int, size: int) -> None:
        """Remember [address, address+size) as usable for transfers."""
        if address <= 0 or size <= 0:
            raise StoreError(StoreCode.INVALID_PARAMS, f"cannot register buffer 0x{address:x} of {size} bytes")
        with self._lock:
            self._check_open()
            self._registered[address] = size

    def unregister_buffer(self, address: int) -> None:
        """Forget the buffer registered at address."""
        with self._lock:
            self._check_open()
            if self._registered.pop(address, None) is None:
                raise StoreError(StoreCode.INVALID_PARAMS, f"no buffer registered at 0x{address:x}")

    def exists(self, keys: Sequence[str]) -> list[Presence]:
        """One batch existence check."""
        with self._lock:
            self._check_open()
            result = []
            for key in keys:
                forced = self._forced("exists", key)
                if forced is None:
                    result.append(Presence.PRESENT if key in self._values else Presence.ABSENT)
                else:
                    result.append(presence_of_failure(forced))
            return result

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        device: bool = False,
        pin: Pin | None = None,
    ) -> list[StoreCode]:
        """One batch put; an existing key keeps its old value and pin and reports OK. It reads every buffer on the
        CPU: device buffers are those of the device path standing in for a GPU's (host memory)."""
        check_batch_shapes(keys, addresses, sizes)
        with self._lock:
            self._check_open()
            return [self._put_one(key, a, s, pin) for key, a, s in zip(keys, addresses, sizes, strict=True)]

    def pin(
        self, keys: Sequence[str], sizes: Sequence[int], pin: Pin | None, *, hard_before: bool = False
    ) -> list[StoreCode]:
        """Each stored value of its size gets the pin (None: ordinary); NOT_FOUND where it is not there."""
        if len(sizes) != len(keys):
            raise StoreError(StoreCode.INVALID_PARAMS, f"{len(keys)} keys but {len(sizes)} sizes")
        with self._lock:
            self._check_open()
            out = []
            for key, size in zip(keys, sizes, strict=True):
                forced = self._forced("pin", key)
                value = self._values.get(key)
                if forced is not None:
                    out.append(forced)
                elif value is None:
                    out.append(StoreCode.NOT_FOUND)
                elif len(value) != size:
                    out.append(StoreCode.SIZE_MISMATCH)
                else:
                    self._set_pin(key, pin)
                    out.append(StoreCode.OK)
            return out

    def get_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[StoreCode]:
        """One batch get; OK only when the value is exactly sum(sizes) bytes, else nothing is written."""
        check_batch_shapes(keys, addresses, sizes)
        with self._lock:
            self._check_open()
            return [self._get_one(key, a, s) for key, a, s in zip(keys, addresses, sizes, strict=True)]

    def locate(self, keys: Sequence[str]) -> Iterable[Replica | None]:
        """None for every key: values live in Python objects here, not in a segment anyone may copy from."""
        with self._lock:
            self._check_open()
        return [None] * len(keys)

    def segment(self) -> Replica | None:
        """None: no segment memory."""
        return None

    def remove(self, keys: Sequence[str], *, force: bool = True) -> list[StoreCode]:
        """Remove each key; NOT_FOUND for a key that is not there (no leases here, so force changes nothing)."""
        with self._lock:
            self._check_open()
            out = []
            for key in keys:
                value = self._values.pop(key, None)
                self._pins.pop(key, None)
                if value is None:
                    out.append(StoreCode.NOT_FOUND)
                else:
                    self._used -= len(value)
                    out.append(StoreCode.OK)
            return out

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Remove every key that starts with prefix (and fully matches rest after it); return how many."""
        if not prefix:
            raise StoreError(StoreCode.INVALID_PARAMS, "an empty prefix would remove every key")
        tail = re.compile(rest) if rest else None
        with self._lock:
            self._check_open()
            doomed = [
                key
                for key in self._values
                if key.startswith(prefix) and (tail is None or tail.fullmatch(key, len(prefix)))
            ]
            for key in doomed:
                self._used -= len(self._values.pop(key))
                self._pins.pop(key, None)
            return len(doomed)

    def tiers(self, keys: Sequence[str]) -> list[str]:
        """Every stored value is in memory; an absent key is ""."""
        with self._lock:
            self._check_open()
            return ["memory" if key in self._values else "" for key in keys]

    def readable(self, key: str) -> bool:
        """Whether key has a value that a get would serve now (faults included)."""
        with self._lock:
            self._check_open()
            return key in self._values and self._forced("get", key) is None

    def health(self) -> StoreHealth:
        """Healthy while open."""
        with self._lock:
            if self._closed:
                health = StoreHealth(False, "the memory store is closed")
            else:
                health = StoreHealth(True, f"memory store: {len(self._values)} keys, {self._used} bytes")
        return health._replace(detail=f"{health.detail}; {self._health_note}") if self._health_note else health

    def note_health(self, note: str) -> None:
        """A line health() adds to its detail from now on."""
        self._health_note = note

    def close(self) -> None:
        """Drop all values; later calls raise StoreUnavailable."""
        with self._lock:
            self._closed = True
            self._values.clear()
            self._pins.clear()
            self._registered.clear()
            self._used = 0

    # Helpers; all run under self._lock.

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("the memory store is closed")

    def _forced(self, op: Operation, key: str) -> StoreCode | None:
        if self._fault is None:
            return None
        forced = self._fault(op, key)
        # An OK from the hook means "do the work", so a test cannot make a failed operation look successful.
        return None if forced is StoreCode.OK else forced

    def _check_registered(self, addresses: Sequence[int], sizes: Sequence[int]) -> bool:
        if not self._require_registration:
            return True
        return all(
            any(start <= a and a + s <= start + length for start, length in self._registered.items())
            for a, s in zip(addresses, sizes, strict=True)
        )

    def _set_pin(self, key: str, pin: Pin | None) -> None:
        if pin is None:
            self._pins.pop(key, None)
        else:
            self._pins[key] = pin

    def _put_one(self, key: str, addresses: Sequence[int], sizes: Sequence[int], pin: Pin | None) -> StoreCode:
        forced = self._forced("put", key)
        if forced is not None:
            return forced
        total = sum(sizes)
        if not key or total <= 0 or any(s <= 0 for s in sizes) or not self._check_registered(addresses, sizes):
            return StoreCode.INVALID_PARAMS
        if key in self._values:
            return StoreCode.OK
        if self._capacity is not None and self._used + total > self._capacity:
            return StoreCode.NO_SPACE
        self._values[key] = b"".join(ctypes.string_at(a, s) for a, s in zip(addresses, sizes, strict=True))
        self._set_pin(key, pin)
        self._used += total
        return StoreCode.OK

    def _get_one(self, key: str, addresses: Sequence[int], sizes: Sequence[int]) -> StoreCode:
        forced = self._forced("get", key)
        if forced is not None:
            return forced
        if any(s <= 0 for s in sizes) or not self._check_registered(addresses, sizes):
            return StoreCode.INVALID_PARAMS
        value = self._values.get(key)
        if value is None:
            return StoreCode.NOT_FOUND
        if len(value) != sum(sizes):
            return StoreCode.SIZE_MISMATCH
        offset = 0
        for address, size in zip(addresses, sizes, strict=True):
            ctypes.memmove(address, value[offset : offset + size], size)
            offset += size
        return StoreCode.OK
