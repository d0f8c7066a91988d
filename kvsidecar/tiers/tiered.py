"""A Store made of a DRAM store with the disk engine behind it: one store to the data path.

- put: into DRAM, and every value DRAM took (or refused for lack of space) is copied and written behind to disk.
  A value DRAM had no room for but the disk queue took is reported stored: it is readable once written.
- exists: in DRAM or written to disk; a value still queued is not claimed, so a hit is never one that cannot load.
  What it finds on disk alone is prefetched (the load that usually follows finds its bytes read or on the way).
- get: from DRAM, and each DRAM miss from disk straight into the caller's buffers (checksum verified).
- remove: from both.
- tiers: where each key is now (DRAM's answer, else "disk" for a value written to disk); what served each get is
  told to `on_served` as it happens (the tier-hit metrics), so no location query follows a load.

Disk only, for a while (`disk_only_for`): a daemon killed -9 and restarted against an external master that still
lists the dead daemon's segment (until the master's client TTL expires it) would have its DRAM reads routed to a
segment nobody serves. So for that long lookups and loads ask the disk alone: what the dead daemon wrote is served
from disk, what only its DRAM held is a miss, and no read is sent to the dead segment. Saves go to DRAM as always.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from kvsidecar.errors import StoreError
from kvsidecar.store.base import Pin, Presence, Replica, Store, StoreHealth, check_batch_shapes
from kvsidecar.store.codes import StoreCode, presence_of_failure
from kvsidecar.tiers.engine import DiskEngine
from kvsidecar.tiers.results import ReadResult

__all__ = ["TieredStore"]

MEMORY, DISK = "memory", "disk"
# DRAM answers after which the disk is asked: the value may be there. Bad parameters are the caller's.
_NOT_FROM_DRAM = frozenset(StoreCode) - {StoreCode.OK, StoreCode.INVALID_PARAMS}


Served = Callable[[Sequence[str], Sequence[int]], None]  # (the tier of each value a get served, its bytes)


class TieredStore:
    """DRAM first, the disk tier behind it; the disk engine is closed with the store."""

    def __init__(self, dram: Store, disk: DiskEngine, on_served: Served = lambda tiers, sizes: None) -> None:
        """Wrap dram with disk; both are owned (closed) by this store from now on. on_served hears, for every get,
        which tier served each value it loaded and how many bytes."""
        self.dram = dram
        self.disk = disk
        self._on_served = on_served
        self._health_note = ""
        self._disk_only_until = 0.0  # time.monotonic() before which DRAM is not read

    def disk_only_for(self, seconds: float) -> None:
        """Answer lookups and loads from the disk alone for the next `seconds` (see the module docstring)."""
        self._disk_only_until = time.monotonic() + max(0.0, seconds)

    def disk_only(self) -> bool:
        """Whether lookups and loads ask the disk alone now."""
        return self._disk_only_until > 0 and time.monotonic() < self._disk_only_until

    def register_buffer(self, address: int, size: int) -> None:
        """Register with DRAM (the disk reads into any memory)."""
        self.dram.register_buffer(address, size)

    def unregister_buffer(self, address: int) -> None:
        """Undo register_buffer."""
        self.dram.unregister_buffer(address)

    def exists(self, keys: Sequence[str]) -> list[Presence]:
        """PRESENT when DRAM has the key or the disk has written it; DRAM's answer otherwise."""
        if self.disk_only():
            on_disk = self.disk.contains(keys)
            self._prefetch([k for k, there in zip(keys, on_disk, strict=True) if there])
            return [Presence.PRESENT if there else Presence.ABSENT for there in on_disk]
        try:
            found = self.dram.exists(keys)
        except StoreError as exc:
            found = [presence_of_failure(exc.code)] * len(keys)
        asked = [j for j, p in enumerate(found) if p is not Presence.PRESENT]
        on_disk = self.disk.contains([keys[j] for j in asked])
        for j, there in zip(asked, on_disk, strict=True):
            if there:
                found[j] = Presence.PRESENT
        self._prefetch([keys[j] for j, there in zip(asked, on_disk, strict=True) if there])
        return found

    def _prefetch(self, keys: list[str]) -> None:
        """A lookup found these on disk alone: a load usually follows, so the disk starts reading them now."""
        if keys:
            self.disk.prefetch(keys)

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        device: bool = False,
        pin: Pin | None = None,
    ) -> list[StoreCode]:
        """Put into DRAM (pinned there as asked) and queue each stored (or DRAM-refused for space) value for the disk.

        The disk copies on the CPU: from device buffers (GPU memory) it copies DRAM's replica in this process's
        segment instead, and a value DRAM holds elsewhere or refused is not written behind (counted). The disk
        tier keeps its oldest writes out first, pinned or not: pins are DRAM's (docs/retention.md)."""
        codes = _per_key(lambda k, a, s: self.dram.put_from(k, a, s, device=device, pin=pin), keys, addresses, sizes)
        if device:
            return self._behind_device(keys, codes)
        out = []
        for key, a, s, code in zip(keys, addresses, sizes, codes, strict=True):
            if code is StoreCode.OK:
                self.disk.enqueue(key, a, s)  # skipped when the queue is full (counted): DRAM still serves it
            elif code in (StoreCode.NO_SPACE, StoreCode.UNAVAILABLE) and self.disk.enqueue(key, a, s):
                code = StoreCode.OK
            out.append(code)
        return out

    def _behind_device(self, keys: Sequence[str], codes: list[StoreCode]) -> list[StoreCode]:
        stored = [j for j, code in enumerate(codes) if code is StoreCode.OK]
        try:
            # Read-leased: the replica stays put while the disk engine copies it.
            found = self.dram.locate([keys[j] for j in stored]) if stored else []
        except StoreError:
            found = [None] * len(stored)
        for j, replica in zip(stored, found, strict=True):
            if replica is None:
                self.disk.skip("device_source")
            else:
                self.disk.enqueue(keys[j], [replica.address], [replica.size])
        return codes

    def pin(
        self, keys: Sequence[str], sizes: Sequence[int], pin: Pin | None, *, hard_before: bool = False
    ) -> list[StoreCode]:
        """DRAM's values get the pin; the disk's copies are what they were."""
        return self.dram.pin(keys, sizes, pin, hard_before=hard_before)

    def get_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[StoreCode]:
        """Get from DRAM; read what DRAM missed from disk."""
        if self.disk_only():
            check_batch_shapes(keys, addresses, sizes)
            codes = [StoreCode.NOT_FOUND] * len(keys)
        else:
            codes = _per_key(self.dram.get_into, keys, addresses, sizes)
        asked = [j for j, code in enumerate(codes) if code in _NOT_FROM_DRAM]
        tier = [MEMORY] * len(keys)
        if asked:
            results = self.disk.read_into(
                [keys[j] for j in asked], [addresses[j] for j in asked], [sizes[j] for j in asked]
            )
            for j, result in zip(asked, results, strict=True):
                if result is ReadResult.OK:
                    codes[j] = StoreCode.OK
                    tier[j] = DISK
                elif result is ReadResult.SIZE_MISMATCH:
                    codes[j] = StoreCode.SIZE_MISMATCH
                # MISSING, CORRUPT, IO_ERROR: DRAM's miss stands.
        ok = [j for j, code in enumerate(codes) if code is StoreCode.OK]
        if ok:
            self._on_served([tier[j] for j in ok], [sum(sizes[j]) for j in ok])
        return codes

    def locate(self, keys: Sequence[str]) -> Iterable[Replica | None]:
        """DRAM's replicas in this process's segment (none while the disk alone is asked)."""
        return [None] * len(keys) if self.disk_only() else self.dram.locate(keys)

    def segment(self) -> Replica | None:
        """DRAM's segment."""
        return self.dram.segment()

    def tiers(self, keys: Sequence[str]) -> list[str]:
        """Where each key is now: DRAM's answer ("memory", or Mooncake's own "disk"), else "disk" for a value
        this tier has written, else "" (absent)."""
        where = [""] * len(keys) if self.disk_only() else self.dram.tiers(keys)
        asked = [j for j, w in enumerate(where) if not w]
        for j, there in zip(asked, self.disk.contains([keys[j] for j in asked]), strict=True):
            if there:
                where[j] = DISK
        return where

    def readable(self, key: str) -> bool:
        """Whether DRAM or the disk can serve key now."""
        return (not self.disk_only() and self.dram.readable(key)) or self.disk.contains([key])[0]

    def note_health(self, note: str) -> None:
        """A line health() adds to its detail from now on."""
        self._health_note = note

    def remove(self, keys: Sequence[str], *, force: bool = True) -> list[StoreCode]:
        """Remove from both tiers; OK when either had the key."""
        codes = self.dram.remove(keys, force=force)
        on_disk = self.disk.remove(keys)
        return [StoreCode.OK if there else code for code, there in zip(codes, on_disk, strict=True)]

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Remove from both tiers; the larger of the two counts (a key is usually in both)."""
        removed = self.dram.remove_prefix(prefix, rest)
        return max(removed, self.disk.remove_prefix(prefix, rest))

    def health(self) -> StoreHealth:
        """DRAM's health, with the disk tier's recovery note and, while it does not write, why."""
        health = self.dram.health()
        notes = [note for note in (self._health_note, self.disk.not_writing()) if note]
        return health._replace(detail="; ".join([health.detail, *notes])) if notes else health

    def close(self) -> None:
        """Close DRAM, then write out the disk queue and close the disk engine."""
        try:
            self.dram.close()
        finally:
            self.disk.close()


def _per_key(
    call: Callable[[Sequence[str], Sequence[Sequence[int]], Sequence[Sequence[int]]], list[StoreCode]],
    keys: Sequence[str],
    addresses: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
) -> list[StoreCode]:
    """A DRAM batch call's codes; a batch that failed whole is that code for every key (the disk may still serve
    them), except bad parameters, which are the caller's error and raise."""
    try:
        return call(keys, addresses, sizes)
    except StoreError as exc:
        if exc.code is StoreCode.INVALID_PARAMS:
            raise
        return [exc.code] * len(keys)
