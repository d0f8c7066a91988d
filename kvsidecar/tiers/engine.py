"""The disk tier's engine: segment files written behind in batches, an index in memory, reads into caller memory.

- Values are copied at enqueue (the caller may reuse its memory at once), each into a page-aligned buffer padded to
  4 KiB, and checksummed; the queue is bounded, and past the bound a value is skipped and counted, never waited for.
  One writer thread writes each batch of queued values with one pwritev of those buffers (O_DIRECT where the
  filesystem takes it), makes it durable, then appends the batch's index records and makes those durable: an index
  record never names bytes not on disk.
- Segment files (segments.py) are preallocated and append-only; their bytes on disk count against the capacity, and
  a new file drops the oldest ones (with every value in them) until it fits, each drop logged and counted.
- A filesystem that refuses writes (full, failing) is an episode (writing.py), told once; `writing()` says why.
- Reads look a key up in memory and preadv straight into the caller's buffers, a few at once; the value's checksum
  is verified there, and a mismatch (a corrupted or truncated file) is a miss, counted, and the key forgotten.
- Prefetch: a lookup that finds values on disk alone hands their extents (adjacent values as one range) to the
  kernel's readahead (POSIX_FADV_WILLNEED) from a thread of its own, so the disk reads them while the lookup answers
  and the load that usually follows is asked for; that load then finds its bytes in memory or on the way.
- Recovery (recovery.py) replays each segment's index, cutting a torn or corrupted tail.

The index, the files and the queue are one object under one lock (index.py); the writer thread is writer.py's; this
module is what callers ask, and the reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvsidecar.tiers.files import (
    ALIGN,
    SegmentFile,
    accepts_direct,
    copy_in,
    default_file_size,
    read_value,
    round_up,
    will_need,
)
from kvsidecar.tiers.index import DiskIndex, Pending
from kvsidecar.tiers.records import MAX_KEY_BYTES
from kvsidecar.tiers.recovery import Entry
from kvsidecar.tiers.results import DiskStats, ReadResult
from kvsidecar.tiers.segments import close_if_dead
from kvsidecar.tiers.writer import Writer

__all__ = ["READ_DEPTH", "DiskEngine"]

log = logging.getLogger(__name__)

READ_DEPTH = 4  # reads in flight at once for one batch get


class DiskEngine:
    """One directory's segment files and index; the caller holds the directory's lock."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        *,
        queue_bytes: int,
        file_size: int | None = None,
        direct: bool | None = None,
    ) -> None:
        """Recover what the directory holds and start the writer; direct None: O_DIRECT if the filesystem takes it."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.file_size = round_up(file_size or default_file_size(capacity))
        if self.file_size < ALIGN or capacity < self.file_size:
            raise ValueError(f"capacity {capacity} must hold at least one file of {self.file_size} bytes")
        self.capacity = capacity
        self.queue_bytes = queue_bytes
        self.direct = accepts_direct(self.directory) if direct is None else direct
        self._index = index = DiskIndex(self.directory, self.file_size, capacity, self.direct, queue_bytes)
        self.stats = index.stats
        self.recovery = index.recovery
        self._readers = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="kvsidecar-disk-read")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvsidecar-disk-prefetch")
        self._writer = Writer(index)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's value is on disk (written and indexed) now."""
        x = self._index
        with x.lock:
            return [k in x.entries for k in keys]

    def prefetch(self, keys: Sequence[str]) -> None:
        """Start reading these keys' values into the page cache, on the prefetch thread (unknown keys are skipped)."""
        x = self._index
        with x.lock:
            extents = []
            for key in keys:
                found = x.located(key)
                if found is not None and found[1].rfd >= 0:
                    entry, seg = found
                    seg.readers += 1  # its descriptor stays open until the hint is given
                    extents.append((seg, entry.offset, entry.length))
        if extents:
            try:
                self._prefetcher.submit(self._will_need, extents)
            except RuntimeError:  # closing
                self._done_with(extents)

    def _will_need(self, extents: list[tuple[SegmentFile, int, int]]) -> None:
        try:
            will_need(extents)
        finally:
            self._done_with(extents)

    def _done_with(self, extents: list[tuple[SegmentFile, int, int]]) -> None:
        with self._index.lock:
            for seg, _, _ in extents:
                seg.readers -= 1
                close_if_dead(seg)

    def enqueue(self, key: str, addresses: Sequence[int], sizes: Sequence[int]) -> bool:
        """Copy a value (its buffers, in order) for writing behind; False when skipped (queue full), counted."""
        total = sum(sizes)
        x = self._index
        with x.lock:
            if x.closing or key in x.entries or x.pending[key]:
                return not x.closing
            if len(key.encode()) > MAX_KEY_BYTES:
                x.stats.skipped["too_large"] += 1
                return False
            if x.stats.queued_bytes + total > self.queue_bytes:
                x.stats.skipped["queue_full"] += 1
                return False
            x.stats.queued_bytes += total  # reserved before the copy, outside the lock
            x.pending[key] += 1
            data = x.pool.take(round_up(max(total, 1)))
        checksum = copy_in(data, addresses, sizes)  # written out as it is (no staging copy)
        with x.wake:
            x.seq += 1
            x.queue.append(Pending(x.seq, key, data, total, checksum))
            x.wake.notify()
        return True

    def skip(self, reason: str) -> None:
        """Count a value not written behind, for a reason of the caller's (e.g. its bytes are nowhere the CPU reads)."""
        with self._index.lock:
            self.stats.skipped[reason] += 1

    def read_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[ReadResult]:
        """Read each key's value into its buffers, a few at once; OK only for exactly the value's bytes, verified."""
        x = self._index
        with x.lock:
            jobs = [x.located(key) for key in keys]
            for job in jobs:
                if job is not None:
                    job[1].readers += 1
        try:
            args = list(zip(keys, jobs, addresses, sizes, strict=True))
            if sum(j is not None for j in jobs) <= 1:
                return [self._read_one(*a) for a in args]
            return list(self._readers.map(lambda a: self._read_one(*a), args))
        finally:
            with x.lock:
                for job in jobs:
                    if job is not None:
                        job[1].readers -= 1
                        close_if_dead(job[1])

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Forget each key (and any queued write of it), durably; whether it was on disk or queued."""
        x = self._index
        with x.wake:
            out = [x.forget(key) for key in keys]
            x.wake.notify()
        return out

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Forget every key that starts with prefix (and fully matches the regular expression rest after it)."""
        tail = re.compile(rest) if rest else None
        x = self._index
        with x.wake:
            doomed = [
                k
                for k in list(x.entries) + [k for k, n in x.pending.items() if n]
                if k.startswith(prefix) and (tail is None or tail.fullmatch(k, len(prefix)))
            ]
            removed = sum(x.forget(k) for k in dict.fromkeys(doomed))
            x.wake.notify()
        return removed

    def snapshot(self) -> DiskStats:
        """A copy of the stats."""
        x = self._index
        with x.lock:
            stats = self.stats
            files = len(x.files.segments)
            return dataclasses.replace(stats, blocks=len(x.entries), files=files, skipped=Counter(stats.skipped))

    def not_writing(self) -> str:
        """Why the tier does not write, since when (a full filesystem, a failing disk); "" while it writes."""
        with self._index.lock:
            return self._index.writing.problem()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or skipped); False on timeout."""
        x = self._index
        with x.wake:
            return x.wake.wait_for(lambda: not x.queue and not x.busy, timeout)

    def close(self) -> None:
        """Write out what is queued, stop the writer and close every file."""
        x = self._index
        with x.wake:
            if x.closing:
                return
            x.closing = True
            x.wake.notify_all()
        self._writer.join()
        self._readers.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)
        with x.lock:
            x.files.close()
            x.entries.clear()
        x.pool.clear()

    def _read_one(
        self, key: str, job: tuple[Entry, SegmentFile] | None, addresses: Sequence[int], sizes: Sequence[int]
    ) -> ReadResult:
        """One value read into caller memory, on the caller's thread or the read pool."""
        if job is None:
            return ReadResult.MISSING
        entry, seg = job
        if sum(sizes) != entry.length:
            return ReadResult.SIZE_MISMATCH
        try:
            if read_value(seg.rfd, entry.offset, entry.length, entry.checksum, addresses, sizes):
                return ReadResult.OK
        except OSError as exc:
            log.warning("disk tier: cannot read %r from file %s: %s", key, seg.number, exc)
            with self._index.lock:
                self.stats.read_errors += 1
            return ReadResult.IO_ERROR
        log.warning("disk tier: %r in file %s fails its checksum: a miss, forgotten", key, seg.number)
        with self._index.lock:
            self._index.forget_corrupt(key, entry, seg)
        return ReadResult.CORRUPT
