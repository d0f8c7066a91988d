"""The disk tier's state, under one lock: the index of the values on disk, the segment files, the writes queued
behind, and the counters; forgetting a key, dropping the oldest file, a written batch taken into the index.

The engine (what callers ask) and the writer thread (writer.py) share it; everything here runs under `lock`.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.tiers.files import BufferPool, SegmentFile
from kvsidecar.tiers.records import Record
from kvsidecar.tiers.recovery import Entry, rebuild
from kvsidecar.tiers.results import DiskStats, Recovery
from kvsidecar.tiers.segments import SegmentFiles
from kvsidecar.tiers.writing import Writing

__all__ = ["DiskIndex", "Pending"]

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(slots=True)
class Pending:
    """A write queued behind: a value's copy, or a removal record."""

    seq: int
    key: str
    data: mmap.mmap | None  # the value's copy, page aligned and 4 KiB padded for O_DIRECT; None: a removal record
    length: int = 0
    checksum: int = 0
    settled: bool = False  # written or given up, its buffer back in the pool
    was: Entry | None = None  # a removal record's: where the removed value lies on disk


class DiskIndex:
    """One directory's index and files, recovered from it, and the queue of writes behind."""

    def __init__(self, directory: Path, file_size: int, capacity: int, direct: bool, queue_bytes: int) -> None:
        """Recover what the directory holds (dropping the oldest files past the capacity)."""
        self.directory, self.file_size, self.capacity = directory, file_size, capacity
        self.stats = DiskStats()
        self.writing = Writing(str(directory))
        self.skip_reason = "no_space"  # why values are skipped during a write episode
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.queue: deque[Pending] = deque()
        self.pending: Counter[str] = Counter()  # queued puts per key
        self.removed_at: dict[str, int] = {}  # key -> sequence number of its last removal, while puts are queued
        self.seq = 0
        self.busy = False  # the writer is writing a batch
        self.closing = False
        self.pool = BufferPool(queue_bytes)  # copy buffers to reuse
        began = time.monotonic()
        found = rebuild(directory)
        self.entries: dict[str, Entry] = found.index
        self.stats.bytes = found.bytes
        self.files = SegmentFiles(directory, file_size, capacity, direct, found.segments)
        while self.files.over():  # a smaller --ssd-size than last time
            self.evict_oldest("to fit --ssd-size")
        self.recovery = Recovery(
            len(self.entries), self.stats.bytes, len(self.files.segments), found.cut, time.monotonic() - began
        )

    def located(self, key: str) -> tuple[Entry, SegmentFile] | None:
        """Where key's value is on disk (its index entry and file), or None."""
        entry = self.entries.get(key)
        seg = self.files.segments.get(entry.file) if entry is not None else None
        return None if entry is None or seg is None else (entry, seg)

    def forget(self, key: str) -> bool:
        """Forget key and queue its removal record; whether it was on disk or queued."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.stats.bytes -= entry.length
            seg = self.files.segments.get(entry.file)
            if seg is not None:
                seg.keys.discard(key)
        queued = self.pending[key] > 0
        if queued:
            self.removed_at[key] = self.seq + 1  # every put queued so far is older
        if entry is None and not queued:
            return False
        self.seq += 1
        self.queue.append(Pending(self.seq, key, None, was=entry))
        return True

    def segment_path(self, number: int) -> Path:
        """Where segment file number lies."""
        return self.directory / f"{number:08d}.seg"

    def forget_corrupt(self, key: str, entry: Entry, seg: SegmentFile) -> None:
        """A value that failed its checksum: counted, and forgotten unless it was written again meanwhile."""
        self.stats.corrupt_reads += 1
        if self.entries.get(key) == entry:
            del self.entries[key]
            self.stats.bytes -= entry.length
            seg.keys.discard(key)

    def evict_oldest(self, why: str) -> bool:
        """Drop the oldest file with every value in it (logged, counted); False when there is none."""
        seg = self.files.pop_oldest()
        if seg is None:
            return False
        blocks = nbytes = 0
        for key in seg.keys:
            entry = self.entries.get(key)
            if entry is not None and entry.file == seg.number:
                del self.entries[key]
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
            self.files.disk_bytes() / MiB,
            self.capacity / MiB,
        )
        return True

    def written(self, seg: SegmentFile, items: list[Pending], records: list[Record]) -> None:
        """A batch is durable in seg: its values (not removed while queued, their file not dropped) indexed."""
        for item, record in zip(items, records, strict=True):
            if item.data is None or item.seq < self.removed_at.get(item.key, 0):
                continue  # a removal, or a put removed while queued
            if seg.number not in self.files.segments:
                continue  # evicted meanwhile
            old = self.entries.get(item.key)
            if old is not None:
                self.stats.bytes -= old.length
            self.entries[item.key] = Entry(seg.number, record.offset, record.length, record.checksum)
            seg.keys.add(item.key)
            self.stats.bytes += record.length
            self.stats.written_blocks += 1
            self.stats.written_bytes += record.length
        self.settle(items)
        self.writing.wrote()

    def settle(self, items: list[Pending]) -> None:
        """Done with these queued items, written or not; their buffers go back to the pool."""
        for item in items:
            if item.data is None or item.settled:
                continue
            item.settled = True
            self.stats.queued_bytes -= item.length
            self.pending[item.key] -= 1
            if self.pending[item.key] <= 0:
                del self.pending[item.key]
                self.removed_at.pop(item.key, None)
            self.pool.give(item.data)

    def skipped(self, reason: str, items: list[Pending]) -> None:
        """Values not written, counted under reason, and settled."""
        self.stats.skipped[reason] += sum(1 for item in items if item.data is not None and not item.settled)
        self.settle(items)

    def failed(self, exc: OSError, what: str, values: int) -> None:
        """A write failed: its skip reason, and an episode of the write state."""
        self.skip_reason = self.writing.failed(exc, what, values)
