"""The disk tier's engine: segment files written behind in batches, an index in memory, reads into caller memory.

- Values are copied at enqueue (the caller may reuse its memory at once), each into a page-aligned buffer padded to
  4 KiB, and checksummed; the queue is bounded, and past the bound a value is skipped and counted, never waited for.
  One writer thread writes each batch of queued values with one pwritev of those buffers (O_DIRECT where the
  filesystem takes it), makes it durable, then appends the batch's index records and makes those durable: an index
  record never names bytes not on disk.
- Segment files are preallocated and append-only; the tier holds at most capacity // file_size of them and drops
  the oldest file (with every value in it) to make room.
- Reads look a key up in memory and preadv straight into the caller's buffers, a few at once; the value's checksum
  is verified there, and a mismatch (a corrupted or truncated file) is a miss, counted, and the key forgotten.
- Prefetch: a lookup that finds values on disk alone hands their extents (adjacent values as one range) to the
  kernel's readahead (POSIX_FADV_WILLNEED) from a thread of its own, so the disk reads them while the lookup answers
  and the load that usually follows is asked for; that load then finds its bytes in memory or on the way.
- Recovery (recovery.py) replays each segment's index, cutting a torn or corrupted tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvsidecar.tiers.files import (
    ALIGN,
    Segment,
    accepts_direct,
    default_file_size,
    open_for_reads,
    round_up,
    skip,
    views,
)
from kvsidecar.tiers.records import (
    DELETE,
    MAX_KEY_BYTES,
    PUT,
    Record,
    encode,
    value_checksum,
)
from kvsidecar.tiers.recovery import Entry, rebuild
from kvsidecar.tiers.results import DiskStats, ReadResult, Recovery

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
        self.max_files = max(2, capacity // self.file_size)
        self.queue_bytes = queue_bytes
        self.direct = accepts_direct(self.directory) if direct is None else direct
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._index: dict[str, Entry] = {}
        self._segments: OrderedDict[int, Segment] = OrderedDict()
        self._current: Segment | None = None
        self._queue: deque[_Pending] = deque()
        self._pending: Counter[str] = Counter()  # queued puts per key
        self._removed_at: dict[str, int] = {}  # key -> sequence number of its last removal, while puts are queued
        self._seq = 0
        self._writing = False
        self._closing = False
        self._free: dict[int, list[mmap.mmap]] = {}  # copy buffers to reuse, by size (KV values are few sizes)
        self._free_bytes = 0
        self.recovery = self._recover()
        self._next = max(self._segments, default=0) + 1
        self._dirfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
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
                seg = self._segments.get(entry.file) if entry is not None else None
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
                self._close_if_dead(seg)

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
            data = self._buffer(round_up(max(total, 1)))
        # The copy is written out as it is (no staging copy); its checksum is taken while it is in the cache.
        base = ctypes.addressof(ctypes.c_char.from_buffer(data))
        offset = 0
        for address, size in zip(addresses, sizes, strict=True):
            ctypes.memmove(base + offset, address, size)
            offset += size
        with memoryview(data) as whole, whole[:total] as value:
            checksum = xxhash.xxh3_64_intdigest(value)
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
                seg = self._segments.get(entry.file) if entry is not None else None
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
                        self._close_if_dead(job[1])

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
            s = self.stats
            return DiskStats(
                len(self._index),
                s.bytes,
                len(self._segments),
                s.queued_bytes,
                s.written_blocks,
                s.written_bytes,
                s.evicted_blocks,
                s.corrupt_reads,
                s.read_errors,
                Counter(s.skipped),
            )

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
            for seg in self._segments.values():
                self._close_writer(seg)
                seg.dead = True
                self._close_if_dead(seg)
            self._segments.clear()
            self._index.clear()
        os.close(self._dirfd)
        self._free.clear()

    # Under the lock.

    def _forget(self, key: str) -> bool:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.stats.bytes -= entry.length
            seg = self._segments.get(entry.file)
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

    def _close_if_dead(self, seg: Segment) -> None:
        if seg.dead and seg.readers == 0 and seg.rfd >= 0:
            os.close(seg.rfd)
            seg.rfd = -1

    def _evict_oldest(self) -> bool:
        if not self._segments:
            return False
        number, seg = self._segments.popitem(last=False)
        for key in seg.keys:
            entry = self._index.get(key)
            if entry is not None and entry.file == number:
                del self._index[key]
                self.stats.bytes -= entry.length
                self.stats.evicted_blocks += 1
        seg.keys.clear()
        if seg is self._current:
            self._current = None
        self._close_writer(seg)
        seg.dead = True
        self._close_if_dead(seg)
        for suffix in (".seg", ".idx"):
            (self.directory / f"{number:08d}{suffix}").unlink(missing_ok=True)
        return True

    @staticmethod
    def _close_writer(seg: Segment) -> None:
        for name in ("wfd", "ifd"):
            fd = getattr(seg, name)
            if fd >= 0:
                os.close(fd)
                setattr(seg, name, -1)

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
        seg = self._current
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
                seg = self._current  # the flush may have started a file, or given one up
                if seg is None or seg.used + padded > self.file_size:
                    seg = self._roll()
                if seg is None:
                    with self._lock:
                        self.stats.skipped["no_space"] += 1
                        self._settle([item])
                    continue
            run.append((item, pos))
            pos += padded
        self._flush(seg, run, pos)

    def _flush(self, seg: Segment | None, run: list[tuple[_Pending, int]], pos: int) -> None:
        """Write the run's values with one pwritev, make them durable, then append and sync their index records."""
        if not run:
            return
        items = [item for item, _ in run]
        if seg is None:
            seg = self._roll()  # removal records only, and no file yet
            if seg is None:
                with self._lock:
                    self._settle(items)
                return
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
            reason = "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io_error"
            n = len(records)
            log.warning(
                "disk tier: cannot write file %s: %s; %d value%s skipped", seg.number, exc, n, "" if n == 1 else "s"
            )
            with self._lock:
                self.stats.skipped[reason] += sum(1 for item in items if item.data is not None)
                self._settle(items)
                self._current = None  # a file that failed a write takes no more
                self._close_writer(seg)
            return
        seg.used = base + pos
        with self._lock:
            for item, record in zip(items, records, strict=True):
                if item.data is None or item.seq < self._removed_at.get(item.key, 0):
                    continue  # a removal, or a put removed while queued
                if seg.number not in self._segments:
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
            if self._free_bytes + len(item.data) <= self.queue_bytes:
                self._free.setdefault(len(item.data), []).append(item.data)
                self._free_bytes += len(item.data)

    def _buffer(self, size: int) -> mmap.mmap:
        """A page-aligned copy buffer of size bytes, reused when one is free (under the lock)."""
        free = self._free.get(size)
        if free:
            self._free_bytes -= size
            return free.pop()
        return mmap.mmap(-1, size)

    def _roll(self) -> Segment | None:
        """Start a new preallocated file, dropping the oldest ones to make room; None if the disk refuses."""
        with self._lock:
            if self._current is not None:
                self._close_writer(self._current)
                self._current = None
            while len(self._segments) >= self.max_files:
                self._evict_oldest()
            number = self._next
            self._next += 1
        path = self.directory / f"{number:08d}.seg"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (os.O_DIRECT if self.direct else 0)
        while True:
            wfd = -1
            try:
                wfd = os.open(path, flags, 0o600)
                os.posix_fallocate(wfd, 0, self.file_size)
                ifd = os.open(path.with_suffix(".idx"), os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_TRUNC, 0o600)
                rfd = open_for_reads(path)
                os.fsync(self._dirfd)
                break
            except OSError as exc:
                if wfd >= 0:
                    os.close(wfd)
                path.unlink(missing_ok=True)
                path.with_suffix(".idx").unlink(missing_ok=True)
                with self._lock:
                    # A full filesystem: give back the oldest file and try again while there is one to give.
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._evict_oldest():
                        continue
                log.warning("disk tier: cannot start file %s: %s", path, exc)
                return None
        seg = Segment(number, rfd, wfd=wfd, ifd=ifd)
        with self._lock:
            self._segments[number] = seg
            self._current = seg
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
        dest = views(addresses, sizes)
        try:
            done = 0
            while done < entry.length:
                n = os.preadv(seg.rfd, skip(dest, done), entry.offset + done)
                if n <= 0:
                    break
                done += n
        except OSError as exc:
            log.warning("disk tier: cannot read %r from file %s: %s", key, seg.number, exc)
            with self._lock:
                self.stats.read_errors += 1
            return ReadResult.IO_ERROR
        if done == entry.length and value_checksum(dest) == entry.checksum:
            return ReadResult.OK
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
        self._index, self._segments, self.stats.bytes = found.index, found.segments, found.bytes
        while len(self._segments) > self.max_files:  # a smaller --ssd-size than last time
            self._evict_oldest()
        return Recovery(len(self._index), self.stats.bytes, len(self._segments), found.cut, time.monotonic() - began)


def will_need(extents: list[tuple[Segment, int, int]]) -> None:
    """Hand (file, offset, length) extents to the kernel's readahead, adjacent ones as one range."""
    extents = sorted(extents, key=lambda e: (e[0].number, e[1]))
    i = 0
    while i < len(extents):
        seg, start, length = extents[i]
        end = start + length
        i += 1
        while i < len(extents) and extents[i][0] is seg and extents[i][1] <= round_up(end):
            end = max(end, extents[i][1] + extents[i][2])
            i += 1
        with contextlib.suppress(OSError):  # only a hint: the reads themselves report what fails
            os.posix_fadvise(seg.rfd, start, end - start, os.POSIX_FADV_WILLNEED)
