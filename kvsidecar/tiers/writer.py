"""The disk tier's writer thread: queued values written in batches, each with one pwritev made durable before its
index records are appended and made durable, so an index record never names bytes not on disk; new files started
(dropping the oldest to make room) as the current one fills."""

from __future__ import annotations

import errno
import logging
import os
import threading

from kvsidecar.tiers.files import SegmentFile, skip
from kvsidecar.tiers.index import DiskIndex, Pending
from kvsidecar.tiers.records import DELETE, PUT, Record, encode

__all__ = ["BATCH_BYTES", "Writer"]

log = logging.getLogger(__name__)

MiB = 1 << 20
BATCH_BYTES = 16 * MiB  # one write (one pwritev, one fdatasync) at most, unless a single value is larger
_BATCH_VALUES = 512  # and at most this many values (IOV_MAX is 1024)
_SPOILED = 64  # bytes of a value flipped where its removal could not be recorded


class Writer:
    """The thread that writes the index's queue out; it ends once the index is closing and its queue is empty."""

    def __init__(self, index: DiskIndex) -> None:
        self.index = index
        self._thread = threading.Thread(target=self._run, name="kvsidecar-disk-writer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread to end (after the index is told it is closing)."""
        self._thread.join()

    def _run(self) -> None:
        x = self.index
        while True:
            with x.wake:
                x.wake.wait_for(lambda: x.queue or x.closing)
                if not x.queue:
                    return
                batch: list[Pending] = []
                size = 0
                while x.queue and len(batch) < _BATCH_VALUES:
                    nxt = len(x.queue[0].data or b"")
                    if batch and size + nxt > BATCH_BYTES:
                        break
                    batch.append(x.queue.popleft())
                    size += nxt
                x.busy = True
            try:
                self._write(batch)
            except Exception:  # the writer must outlive any one batch; its values are skipped and counted
                log.exception("disk tier: a write batch failed")
                with x.lock:
                    x.skipped("io_error", batch)
            with x.wake:
                x.busy = False
                x.wake.notify_all()

    def _write(self, batch: list[Pending]) -> None:
        x = self.index
        run: list[tuple[Pending, int]] = []  # (item, its offset in the run) of the next write
        pos = 0
        seg = x.files.current
        for item in batch:
            if item.data is None:
                run.append((item, 0))
                continue
            padded = len(item.data)
            if padded > x.file_size:
                with x.lock:
                    x.skipped("too_large", [item])
                continue
            if seg is None or seg.used + pos + padded > x.file_size:
                self._flush(seg, run, pos)
                run, pos = [], 0
                seg = x.files.current  # the flush may have started a file, or given one up
                if seg is None or seg.used + padded > x.file_size:
                    rolled = self._roll()
                    if isinstance(rolled, str):
                        with x.lock:
                            x.skipped(rolled, [item])
                        seg = None
                        continue
                    seg = rolled
            run.append((item, pos))
            pos += padded
        self._flush(seg, run, pos)

    def _flush(self, seg: SegmentFile | None, run: list[tuple[Pending, int]], pos: int) -> None:
        """Write the run's values with one pwritev, make them durable, then append and sync their index records."""
        if not run:
            return
        x = self.index
        items = [item for item, _ in run]
        if seg is None:
            rolled = self._roll()  # removal records only, and no file yet
            if isinstance(rolled, str):
                self._spoil(items)
                with x.lock:
                    x.settle(items)
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
            _write_all(seg.ifd, b"".join(encode(r) for r in records))
            os.fdatasync(seg.ifd)
        except OSError as exc:
            self._spoil(items)
            with x.lock:
                x.failed(exc, f"cannot write file {seg.number:08d}", sum(1 for i in items if i.data is not None))
                x.skipped(x.skip_reason, items)
                if seg is x.files.current:  # a file that failed a write takes no more
                    x.files.retire_current()
            return
        seg.used = base + pos
        with x.lock:
            x.written(seg, items, records)

    def _spoil(self, items: list[Pending]) -> None:
        """Removals whose records could not be written: their values' bytes are spoiled where they lie instead, so
        that a restart, which rebuilds the index from the records, finds them failing their checksums (counted
        misses) rather than serves them again. A removed value may hold bytes nobody may read any more (a save
        revoked past its deadline). Spoiling overwrites bytes already on disk: it needs no free space."""
        x = self.index
        for item in items:
            if item.data is not None or item.was is None:
                continue
            path = x.segment_path(item.was.file)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # its file is gone: nothing left to serve
            except OSError as exc:
                log.error("disk tier: cannot remove %s from %s (%s): a restart may serve it again", item.key, path, exc)
                continue
            try:
                head = bytearray(os.pread(fd, _SPOILED, item.was.offset))
                # Every bit of the value's first bytes flipped: its checksum cannot come out right again.
                os.pwrite(fd, bytes(b ^ 0xFF for b in head), item.was.offset)
                os.fdatasync(fd)
            except OSError as exc:
                log.error("disk tier: cannot remove %s from %s (%s): a restart may serve it again", item.key, path, exc)
            finally:
                os.close(fd)

    def _roll(self) -> SegmentFile | str:
        """Start a new preallocated file, dropping the oldest ones until it fits; if none can be started, the reason
        its value is skipped for (no_space, io_error)."""
        x = self.index
        with x.lock:
            x.files.retire_current()
            if not x.writing.may_try():
                x.writing.missed(1)
                return x.skip_reason
            while x.files.over(x.file_size):
                x.evict_oldest("to make room for a new file")
            number = x.files.next_number()
        while True:
            try:
                seg = x.files.create(number)
            except OSError as exc:
                with x.lock:
                    # A full filesystem: give back the oldest file and try again while there is one to give.
                    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    if full and x.evict_oldest("to make room: the filesystem is full"):
                        continue
                    x.failed(exc, f"cannot start file {number:08d}", 1)
                    return x.skip_reason
            with x.lock:
                x.files.add(seg)
            return seg


def _write_all(fd: int, data: bytes) -> None:
    """All of data appended, or OSError: a full filesystem takes what fits and refuses the rest only on the next
    write, which a single os.write never makes (its short count would lose the records after the cut silently)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
