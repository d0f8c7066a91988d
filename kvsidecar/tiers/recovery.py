"""The disk tier's recovery, before its writer starts: the index rebuilt from the segment files a directory holds.

Each segment's index file is replayed in order (a later record of a key replaces or removes an earlier one); a torn
or corrupted tail is cut, and the cut made durable; a value past the end of a truncated segment file is dropped
(those before the cut are kept); a segment left with no value is removed with its index; every kept segment is
opened for reads, knowing where its values end (its records', removed ones included: their bytes are still there)
and what it takes on disk.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvsidecar.tiers.files import SegmentFile, open_for_reads, round_up
from kvsidecar.tiers.records import PUT, decode_raw, segment_numbers

__all__ = ["Entry", "Rebuilt", "rebuild"]

log = logging.getLogger(__name__)


class Entry(NamedTuple):
    """Where one value lies: its segment file's number, its offset and length there, and its checksum."""

    file: int
    offset: int
    length: int
    checksum: int


@dataclass
class Rebuilt:
    """What a directory holds: the index, its segments oldest first, their values' bytes, the tails cut."""

    index: dict[str, Entry] = field(default_factory=dict)
    segments: OrderedDict[int, SegmentFile] = field(default_factory=OrderedDict)
    bytes: int = 0
    cut: int = 0

    def drop(self, key: str) -> None:
        """Forget key's value (a later record replaces or removes it)."""
        old = self.index.pop(key, None)
        if old is not None:
            self.bytes -= old.length
            seg = self.segments.get(old.file)
            if seg is not None:
                seg.keys.discard(key)


def rebuild(directory: Path) -> Rebuilt:
    """The index of the segment files in directory, their torn tails cut and their empty files removed."""
    found = Rebuilt()
    for number in segment_numbers(directory):
        path = directory / f"{number:08d}.seg"
        idx = path.with_suffix(".idx")
        try:
            data = idx.read_bytes()
            size = path.stat().st_size
        except FileNotFoundError:
            data, size = b"", 0
        records, good = decode_raw(data)
        if good < len(data):
            found.cut += 1
            log.warning("disk tier: cut %d bytes of torn index at the end of %s", len(data) - good, idx)
            with open(idx, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        seg = found.segments[number] = SegmentFile(number, -1, size=size)
        index, keys = found.index, seg.keys
        end = 0
        for kind, key, offset, length, checksum in records:
            if key in index:
                found.drop(key)
            if kind == PUT and offset + length <= size:  # a truncated file keeps the values before the cut
                index[key] = tuple.__new__(Entry, (number, offset, length, checksum))
                found.bytes += length
                keys.add(key)
                end = max(end, offset + length)
        seg.used = round_up(end)
    for number, seg in list(found.segments.items()):
        if not seg.keys:
            del found.segments[number]
            for suffix in (".seg", ".idx"):
                (directory / f"{number:08d}{suffix}").unlink(missing_ok=True)
        else:
            seg.rfd = open_for_reads(directory / f"{number:08d}.seg")
    return found
