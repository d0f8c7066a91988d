"""Shared-memory segments that catch every byte the daemon writes where it must not.

A `GuardedSegment` is a named POSIX shared-memory segment the test owns, filled with a position-dependent canary
pattern. The test keeps its own copy of what every byte should hold (`expected`); after each operation it asks which
byte ranges changed, and checks each range lies inside a block slice that the operation was allowed to write (a Load
of the session owning that memory, into block ids it named). Everything else (the slack before and after a region,
the gaps between block slices when block_bytes < stride, blocks no request named, every byte during a Save or a
Lookup) must stay as it was.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from kvsidecar_contract.proto import sidecar_pb2 as pb

SHM_DIR = "/dev/shm"

Range = tuple[int, int]  # [start, end) in bytes from the start of a segment
_LIVE: set[GuardedSegment] = set()


def canary(seed: int, size: int) -> bytes:
    """A pattern that differs per segment and per position, so a shifted or foreign copy is caught too."""
    idx = np.arange(size, dtype=np.uint64)
    return ((idx * np.uint64(2654435761) + np.uint64(seed)) >> np.uint64(7)).astype(np.uint8).tobytes()


class Geometry(NamedTuple):
    """A strided region inside a segment: block b is [offset + b * stride, + block_bytes)."""

    offset: int
    stride: int
    block_bytes: int
    num_blocks: int

    @property
    def end(self) -> int:
        """One past the region's last byte."""
        return self.offset + (self.num_blocks - 1) * self.stride + self.block_bytes

    def slice_of(self, block_id: int) -> Range:
        """Where block_id's bytes are."""
        start = self.offset + block_id * self.stride
        return start, start + self.block_bytes

    def slices(self, block_ids: Iterable[int]) -> list[Range]:
        """The slices of the given ids that fall inside the region (others cannot be written legitimately)."""
        return [self.slice_of(b) for b in sorted(set(block_ids)) if 0 <= b < self.num_blocks]


class GuardedSegment:
    """A segment of `size` bytes filled with a canary; the test tracks what each byte should hold."""

    def __init__(self, size: int, *, prefix: str = "kvsidecar-fuzz") -> None:
        if size < 1:
            raise ValueError(f"a segment needs at least one byte, got {size}")
        self.name = f"{prefix}-{secrets.token_hex(6)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self.expected = bytearray(canary(int.from_bytes(secrets.token_bytes(4), "little"), size))
        self._mm[:] = self.expected
        self.truncated = False
        self._closed = False
        _LIVE.add(self)

    # --- what the test writes ---

    def write(self, offset: int, data: bytes) -> None:
        """Write through the test's own mapping and record it as expected."""
        self._mm[offset : offset + len(data)] = data
        self.expected[offset : offset + len(data)] = data

    def read(self, offset: int, n: int) -> bytes:
        """Bytes as they are now."""
        return bytes(self._mm[offset : offset + n])

    # --- what the daemon wrote ---

    def changed(self) -> list[Range]:
        """Byte ranges that differ from what the test expects (empty when nothing moved)."""
        if self.truncated:
            return []  # reading past the new end would SIGBUS the test process
        want = np.frombuffer(self.expected, dtype=np.uint8)
        diff = np.flatnonzero(self._view != want)
        if not diff.size:
            return []
        breaks = np.flatnonzero(np.diff(diff) != 1)
        starts = np.concatenate(([diff[0]], diff[breaks + 1]))
        ends = np.concatenate((diff[breaks], [diff[-1]])) + 1
        return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]

    def accept(self, ranges: Iterable[Range]) -> None:
        """Take the current bytes of these ranges as expected (after checking they were allowed)."""
        for start, end in ranges:
            self.expected[start:end] = self._mm[start:end]

    def violations(self, allowed: Sequence[Range]) -> list[Range]:
        """Changed ranges not covered by `allowed`; the allowed changes are accepted as the new expected bytes."""
        bad: list[Range] = []
        ok: list[Range] = []
        for start, end in self.changed():
            outside = _outside((start, end), allowed)
            bad.extend(outside)
            if not outside:
                ok.append((start, end))
        self.accept(ok)
        return bad

    # --- hostile clients ---

    def truncate(self, size: int) -> None:
        """Shrink the file under every mapping (the test stops reading its own mapping)."""
        self.truncated = True
        os.truncate(self.path, size)

    def close(self) -> None:
        """Unmap and unlink (the daemon's mapping, if any, stays valid until it unmaps)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        del self._view
        self._mm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def close_leftovers() -> int:
    """Close every segment a failed test left open; returns how many there were."""
    left = list(_LIVE)
    for segment in left:
        segment.close()
    return len(left)


def region(
    segment: GuardedSegment, geometry: Geometry, groups: Sequence[int], *, mapping_bytes: int | None = None
) -> pb.MemoryRegion:
    """The MemoryRegion message for a geometry inside a guarded segment."""
    return pb.MemoryRegion(
        shm=pb.SharedMemoryHandle(name=segment.name),
        mapping_bytes=segment.size if mapping_bytes is None else mapping_bytes,
        offset=geometry.offset,
        block_stride=geometry.stride,
        block_bytes=geometry.block_bytes,
        num_blocks=geometry.num_blocks,
        groups=list(groups),
    )


def _outside(r: Range, allowed: Sequence[Range]) -> list[Range]:
    """The parts of r that no allowed range covers."""
    pieces = [r]
    for a_start, a_end in allowed:
        nxt: list[Range] = []
        for start, end in pieces:
            if a_end <= start or end <= a_start:
                nxt.append((start, end))
                continue
            if start < a_start:
                nxt.append((start, a_start))
            if a_end < end:
                nxt.append((a_end, end))
        pieces = nxt
        if not pieces:
            break
    return pieces
