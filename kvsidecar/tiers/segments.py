"""The disk tier's segment files as a set: which exist (oldest first), the one being appended to, and the bytes they
take on disk, which the tier's capacity counts.

The file being appended to is preallocated whole; a file that takes no more values is cut to what it uses, giving
its preallocation back. After a restart the newest recovered file is appended to from where its values end, so a
restart costs no new file (a crash-looping daemon would otherwise fill the tier with nearly empty ones); the older
ones are cut, as a killed daemon may have left them preallocated. The engine calls all of it under its lock, except
`create`, the I/O of a new file.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from kvsidecar.tiers.files import ALIGN, SegmentFile, open_for_reads

__all__ = ["SegmentFiles"]

log = logging.getLogger(__name__)


class SegmentFiles:
    """One directory's segment files, oldest first, and the one being appended to."""

    def __init__(
        self, directory: Path, file_size: int, capacity: int, direct: bool, recovered: OrderedDict[int, SegmentFile]
    ) -> None:
        """Take over what recovery found: append to the newest file where it can, cut the others."""
        self.directory, self.file_size, self.capacity, self.direct = directory, file_size, capacity, direct
        self.segments = recovered
        self.current: SegmentFile | None = None
        self._next = max(recovered, default=0) + 1
        self._dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        newest = next(reversed(recovered.values()), None)
        for seg in recovered.values():
            if seg is not newest or not self._go_on_with(seg):
                self._cut(seg)

    def disk_bytes(self) -> int:
        """Bytes the files take on disk now."""
        return sum(seg.size for seg in self.segments.values())

    def over(self, extra: int = 0) -> bool:
        """Whether the files, and extra bytes more, would take more than the capacity (while there is a file)."""
        return bool(self.segments) and self.disk_bytes() + extra > self.capacity

    def retire_current(self) -> None:
        """The file being appended to takes no more values."""
        if self.current is not None:
            self.retire(self.current)
            self.current = None

    def retire(self, seg: SegmentFile) -> None:
        """seg takes no more values: its writers closed, the file cut to what it uses."""
        if seg.wfd >= 0 and seg.size > seg.used:
            try:
                os.ftruncate(seg.wfd, seg.used)
                seg.size = seg.used
            except OSError as exc:
                log.warning("disk tier: cannot cut file %08d to its %d bytes: %s", seg.number, seg.used, exc)
        close_writer(seg)

    def next_number(self) -> int:
        """The number of the next new file."""
        number = self._next
        self._next += 1
        return number

    def create(self, number: int) -> SegmentFile:
        """A new preallocated file with an empty index, opened for appending and reading (OSError: nothing left)."""
        path = self.directory / f"{number:08d}.seg"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (os.O_DIRECT if self.direct else 0)
        wfd = -1
        try:
            wfd = os.open(path, flags, 0o600)
            os.posix_fallocate(wfd, 0, self.file_size)
            ifd = os.open(path.with_suffix(".idx"), os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_TRUNC, 0o600)
            rfd = open_for_reads(path)
            os.fsync(self._dirfd)
        except OSError:
            if wfd >= 0:
                os.close(wfd)
            path.unlink(missing_ok=True)
            path.with_suffix(".idx").unlink(missing_ok=True)
            raise
        return SegmentFile(number, rfd, wfd=wfd, ifd=ifd, size=self.file_size)

    def add(self, seg: SegmentFile) -> None:
        """A file create() made, appended to from now on."""
        self.segments[seg.number] = seg
        self.current = seg

    def pop_oldest(self) -> SegmentFile | None:
        """Remove the oldest file from disk (its descriptor for reads closes once no read uses it)."""
        if not self.segments:
            return None
        number, seg = self.segments.popitem(last=False)
        if seg is self.current:
            self.current = None
        close_writer(seg)
        seg.dead = True
        close_if_dead(seg)
        for suffix in (".seg", ".idx"):
            (self.directory / f"{number:08d}{suffix}").unlink(missing_ok=True)
        return seg

    def close(self) -> None:
        """Close every file (the one being appended to stays preallocated: the next start goes on with it)."""
        for seg in self.segments.values():
            close_writer(seg)
            seg.dead = True
            close_if_dead(seg)
        self.segments.clear()
        self.current = None
        os.close(self._dirfd)

    def _go_on_with(self, seg: SegmentFile) -> bool:
        """Append to a recovered file from where its values end; False if it cannot take more."""
        if seg.used + ALIGN > self.file_size or seg.size > self.file_size:
            return False
        path = self.directory / f"{seg.number:08d}.seg"
        wfd = -1
        try:
            wfd = os.open(path, os.O_WRONLY | (os.O_DIRECT if self.direct else 0))
            os.posix_fallocate(wfd, 0, self.file_size)
            seg.ifd = os.open(path.with_suffix(".idx"), os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            log.info("disk tier: not appending to file %s (%s): new values go to a new file", path.name, exc)
            if wfd >= 0:
                os.close(wfd)
            return False
        seg.wfd, seg.size = wfd, self.file_size
        self.current = seg
        return True

    def _cut(self, seg: SegmentFile) -> None:
        if seg.size <= seg.used:
            return
        try:
            os.truncate(self.directory / f"{seg.number:08d}.seg", seg.used)
            seg.size = seg.used
        except OSError as exc:
            log.warning("disk tier: cannot cut file %08d to its %d bytes: %s", seg.number, seg.used, exc)


def close_writer(seg: SegmentFile) -> None:
    """Close the descriptors seg is appended through."""
    for name in ("wfd", "ifd"):
        fd = getattr(seg, name)
        if fd >= 0:
            os.close(fd)
            setattr(seg, name, -1)


def close_if_dead(seg: SegmentFile) -> None:
    """Close a dropped file's descriptor for reads once no read uses it."""
    if seg.dead and seg.readers == 0 and seg.rfd >= 0:
        os.close(seg.rfd)
        seg.rfd = -1
