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
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.tiers.files import (
    ALIGN,
    BufferPool,
    Segment,
    accepts_direct,
    copy_in,
    default_file_size,
    read_value,
    round_up,
    skip,
    will_need,
)
from kvsidecar.tiers.records import DELETE, MAX_KEY_BYTES, PUT, Record, encode
from kvsidecar.tiers.recovery import Entry, rebuild
from kvsidecar.tiers.results import DiskStats, ReadResult, Recovery
from kvsidecar.tiers.segments import SegmentFiles, close_if_dead
from kvsidecar.tiers.writing import Writing

__all__ = ["DiskEngine"]

log = logging.getLogger(__name__)

MiB = 1 << 20
BATCH_BYTES = 16 * MiB  # one write (one pwritev, one fdatasync) at most, unless a single value is larger
_BATCH_VALUES = 512  # and at most this many values (IOV_MAX is 1024)
READ_DEPTH = 4  # reads in flight at once for one batch get


@dataclass(slots=True)
class _Pending:
    seq: int
    key: str
    data: mmap.mmap | None  # the value's copy, page aligned and 4 KiB padded for O_DIRECT; None: a removal record
    length: int = 0
    checksum: int = 0
    settled: bool = False  # written or given up, its buffer back in the pool


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
        self.stats = DiskStats()
        self._writing_state = Writing(str(self.directory))
        self._skip_reason = "no_space"  # why values are skipped during a write episode
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: dict[str, Entry] = {}
        self._queue: deque[_Pending] = deque()
        self._pending: Counter[str] = Counter()  # queued puts per key
        self._removed_at: dict[str, int] = {}  # key -> sequence number of its last removal, while puts are queued
        self._seq = 0
        self._writing = False
        self._closing = False
        self._pool = BufferPool(queue_bytes)  # copy buffers to reuse
        self.recovery = self._recover()
        self._readers = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="kvsidecar-disk-read")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvsidecar-disk-prefetch")
        self._writer = threading.Thread(target=self._run, name="kvsidecar-disk-writer", daemon=True)
        self._writer.start()

    # What callers ask.

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's value is on disk (written and indexed) now."""
        with self._lock:
            return [k in self._index for k in keys]

    def prefetch(self, keys: Sequence[str]) -> None:
        """Start reading these keys' values into the page cache, on the prefetch thread (unknown keys are skipped)."""
        with self._lock:
            extents = []
            for key in keys:
                entry = self._index.get(key)
                seg = self._files.segments.get(entry.file) if entry is not None else None
                if entry is not None and seg is not None and seg.rfd >= 0:
                    seg.readers += 1  # its descriptor stays open until the hint is given
                    extents.append((seg, entry.offset, entry.length))
        if extents:
            try:
                self._prefetcher.submit(self._will_need, extents)
            except RuntimeError:  # closing
                self._done_with(extents)

    def _will_need(self, extents: list[tuple[Segment, int, int]]) -> None:
        try:
            will_need(extents)
        finally:
            self._done_with(extents)

    def _done_with(self, extents: list[tuple[Segment, int, int]]) -> None:
        with self._lock:
            for seg, _, _ in extents:
                seg.readers -= 1
                close_if_dead(seg)

    def enqueue(self, key: str, addresses: Sequence[int], sizes: Sequence[int]) -> bool:
        """Copy a value (its buffers, in order) for writing behind; False when skipped (queue full), counted."""
        total = sum(sizes)
        with self._lock:
            if self._closing or key in self._index or self._pending[key]:
                return not self._closing
            if len(key.encode()) > MAX_KEY_BYTES:
                self.stats.skipped["too_large"] += 1
                return False
            if self.stats.queued_bytes + total > self.queue_bytes:
                self.stats.skipped["queue_full"] += 1
                return False
            self.stats.queued_bytes += total  # reserved before the copy, outside the lock
            self._pending[key] += 1
            data = self._pool.take(round_up(max(total, 1)))
        checksum = copy_in(data, addresses, sizes)  # written out as it is (no staging copy)
        with self._wake:
            self._seq += 1
            self._queue.append(_Pending(self._seq, key, data, total, checksum))
            self._wake.notify()
        return True

    def skip(self, reason: str) -> None:
        """Count a value not written behind, for a reason of the caller's (e.g. its bytes are nowhere the CPU reads)."""
        with self._lock:
            self.stats.skipped[reason] += 1

    def read_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[ReadResult]:
        """Read each key's value into its buffers, a few at once; OK only for exactly the value's bytes, verified."""
        jobs: list[tuple[Entry, Segment] | None] = []
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                seg = self._files.segments.get(entry.file) if entry is not None else None
                if entry is None or seg is None:
                    jobs.append(None)
                    continue
                seg.readers += 1
                jobs.append((entry, seg))
        try:
            args = list(zip(keys, jobs, addresses, sizes, strict=True))
            if sum(j is not None for j in jobs) <= 1:
                return [self._read_one(*a) for a in args]
            return list(self._readers.map(lambda a: self._read_one(*a), args))
        finally:
            with self._lock:
                for job in jobs:
                    if job is not None:
                        job[1].readers -= 1
                        close_if_dead(job[1])

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Forget each key (and any queued write of it), durably; whether it was on disk or queued."""
        with self._wake:
            out = [self._forget(key) for key in keys]
            self._wake.notify()
        return out

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Forget every key that starts with prefix (and fully matches the regular expression rest after it)."""
        tail = re.compile(rest) if rest else None
        with self._wake:
            doomed = [
                k
                for k in list(self._index) + [k for k, n in self._pending.items() if n]
                if k.startswith(prefix) and (tail is None or tail.fullmatch(k, len(prefix)))
            ]
            removed = sum(self._forget(k) for k in dict.fromkeys(doomed))
            self._wake.notify()
        return removed

    def snapshot(self) -> DiskStats:
        """A copy of the stats."""
        with self._lock:
            stats = self.stats
            files = len(self._files.segments)
            return dataclasses.replace(stats, blocks=len(self._index), files=files, skipped=Counter(stats.skipped))

    def writing(self) -> str:
        """ "" while the tier writes; else why it does not, since when (a full filesystem, a failing disk)."""
        with self._lock:
            return self._writing_state.problem()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or skipped); False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self) -> None:
        """Write out what is queued, stop the writer and close every file."""
        with self._wake:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
        self._writer.join()
        self._readers.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)
        with self._lock:
            self._files.close()
            self._index.clear()
        self._pool.clear()

    # Under the lock.

    def _forget(self, key: str) -> bool:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.stats.bytes -= entry.length
            seg = self._files.segments.get(entry.file)
            if seg is not None:
                seg.keys.discard(key)
        queued = self._pending[key] > 0
        if queued:
            self._removed_at[key] = self._seq + 1  # every put queued so far is older
        if entry is None and not queued:
            return False
        self._seq += 1
        self._queue.append(_Pending(self._seq, key, None))
        return True

    def _evict_oldest(self, why: str) -> bool:
        """Drop the oldest file with every value in it (logged, counted); False when there is none."""
        seg = self._files.pop_oldest()
        if seg is None:
            return False
        blocks = nbytes = 0
        for key in seg.keys:
            entry = self._index.get(key)
            if entry is not None and entry.file == seg.number:
                del self._index[key]
                self.stats.bytes -= entry.length
                blocks += 1
                nbytes += entry.length
        seg.keys.clear()
        self.stats.evicted_blocks += blocks
        self.stats.evicted_bytes += nbytes
        log.info(
            "disk tier %s: dropped file %08d (%d blocks, %.1f MiB) %s; %.1f of %.1f MiB on disk now",
            self.directory,
            seg.number,
            blocks,
            nbytes / MiB,
            why,
            self._files.disk_bytes() / MiB,
            self.capacity / MiB,
        )
        return True

    # The writer thread.

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch: list[_Pending] = []
                size = 0
                while self._queue and len(batch) < _BATCH_VALUES:
                    nxt = len(self._queue[0].data or b"")
                    if batch and size + nxt > BATCH_BYTES:
                        break
                    batch.append(self._queue.popleft())
                    size += nxt
                self._writing = True
            try:
                self._write(batch)
            except Exception:  # the writer must outlive any one batch; its values are skipped and counted
                log.exception("disk tier: a write batch failed")
                with self._lock:
                    self.stats.skipped["io_error"] += sum(1 for p in batch if p.data is not None and not p.settled)
                    self._settle(batch)
            with self._wake:
                self._writing = False
                self._wake.notify_all()

    def _write(self, batch: list[_Pending]) -> None:
        run: list[tuple[_Pending, int]] = []  # (item, its offset in the run) of the next write
        pos = 0
        seg = self._files.current
        for item in batch:
            if item.data is None:
                run.append((item, 0))
                continue
            padded = len(item.data)
            if padded > self.file_size:
                with self._lock:
                    self.stats.skipped["too_large"] += 1
                    self._settle([item])
                continue
            if seg is None or seg.used + pos + padded > self.file_size:
                self._flush(seg, run, pos)
                run, pos = [], 0
                seg = self._files.current  # the flush may have started a file, or given one up
                if seg is None or seg.used + padded > self.file_size:
                    rolled = self._roll()
                    if isinstance(rolled, str):
                        with self._lock:
                            self.stats.skipped[rolled] += 1
                            self._settle([item])
                        seg = None
                        continue
                    seg = rolled
            run.append((item, pos))
            pos += padded
        self._flush(seg, run, pos)

    def _flush(self, seg: Segment | None, run: list[tuple[_Pending, int]], pos: int) -> None:
        """Write the run's values with one pwritev, make them durable, then append and sync their index records."""
        if not run:
            return
        items = [item for item, _ in run]
        if seg is None:
            rolled = self._roll()  # removal records only, and no file yet
            if isinstance(rolled, str):
                with self._lock:
                    self._settle(items)
                return
            seg = rolled
        base = seg.used
        records = [
            Record(DELETE, item.key, 0, 0, 0)
            if item.data is None
            else Record(PUT, item.key, base + offset, item.length, item.checksum)
            for item, offset in run
        ]
        try:
            if pos:
                bufs = [memoryview(item.data) for item in items if item.data is not None]
                try:
                    done = 0
                    while done < pos:
                        done += os.pwritev(seg.wfd, skip(bufs, done), base + done)
                finally:
                    for v in bufs:
                        v.release()
                os.fdatasync(seg.wfd)
            os.write(seg.ifd, b"".join(encode(r) for r in records))
            os.fdatasync(seg.ifd)
        except OSError as exc:
            with self._lock:
                values = sum(1 for item in items if item.data is not None)
                self._failed(exc, f"cannot write file {seg.number:08d}", values)
                self.stats.skipped[self._skip_reason] += values
                self._settle(items)
                if seg is self._files.current:  # a file that failed a write takes no more
                    self._files.retire_current()
            return
        seg.used = base + pos
        with self._lock:
            for item, record in zip(items, records, strict=True):
                if item.data is None or item.seq < self._removed_at.get(item.key, 0):
                    continue  # a removal, or a put removed while queued
                if seg.number not in self._files.segments:
                    continue  # evicted meanwhile
                old = self._index.get(item.key)
                if old is not None:
                    self.stats.bytes -= old.length
                self._index[item.key] = Entry(seg.number, record.offset, record.length, record.checksum)
                seg.keys.add(item.key)
                self.stats.bytes += record.length
                self.stats.written_blocks += 1
                self.stats.written_bytes += record.length
            self._settle(items)
            self._writing_state.wrote()

    def _settle(self, items: list[_Pending]) -> None:
        """Done with these queued items, written or not (under the lock); their buffers go back to the pool."""
        for item in items:
            if item.data is None or item.settled:
                continue
            item.settled = True
            self.stats.queued_bytes -= item.length
            self._pending[item.key] -= 1
            if self._pending[item.key] <= 0:
                del self._pending[item.key]
                self._removed_at.pop(item.key, None)
            self._pool.give(item.data)

    def _failed(self, exc: OSError, what: str, values: int) -> None:
        """A write failed: its skip reason, and an episode of the write state (under the lock)."""
        self._skip_reason = self._writing_state.failed(exc, what, values)

    def _roll(self) -> Segment | str:
        """Start a new preallocated file, dropping the oldest ones until it fits; if none can be started, the reason
        its value is skipped for (no_space, io_error)."""
        with self._lock:
            self._files.retire_current()
            if not self._writing_state.may_try():
                self._writing_state.missed(1)
                return self._skip_reason
            while self._files.over(self.file_size):
                self._evict_oldest("to make room for a new file")
            number = self._files.next_number()
        while True:
            try:
                seg = self._files.create(number)
            except OSError as exc:
                with self._lock:
                    # A full filesystem: give back the oldest file and try again while there is one to give.
                    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    if full and self._evict_oldest("to make room: the filesystem is full"):
                        continue
                    self._failed(exc, f"cannot start file {number:08d}", 1)
                    return self._skip_reason
            with self._lock:
                self._files.add(seg)
            return seg

    # Reads, on the caller's thread or the read pool.

    def _read_one(
        self, key: str, job: tuple[Entry, Segment] | None, addresses: Sequence[int], sizes: Sequence[int]
    ) -> ReadResult:
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
            with self._lock:
                self.stats.read_errors += 1
            return ReadResult.IO_ERROR
        log.warning("disk tier: %r in file %s fails its checksum: a miss, forgotten", key, seg.number)
        with self._lock:
            self.stats.corrupt_reads += 1
            if self._index.get(key) == entry:
                del self._index[key]
                self.stats.bytes -= entry.length
                seg.keys.discard(key)
        return ReadResult.CORRUPT

    # Recovery, before the writer starts.

    def _recover(self) -> Recovery:
        began = time.monotonic()
        found = rebuild(self.directory)
        self._index, self.stats.bytes = found.index, found.bytes
        self._files = files = SegmentFiles(self.directory, self.file_size, self.capacity, self.direct, found.segments)
        while files.over():  # a smaller --ssd-size than last time
            self._evict_oldest("to fit --ssd-size")
        return Recovery(len(self._index), self.stats.bytes, len(files.segments), found.cut, time.monotonic() - began)
