"""What the disk engine reports: a read's result, what recovery found, and its counters."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["DiskStats", "ReadResult", "Recovery"]


class ReadResult(enum.Enum):
    """What one read of a value into caller memory came to."""

    OK = "ok"
    MISSING = "missing"  # not on disk (never written, evicted, removed, or still queued)
    SIZE_MISMATCH = "size_mismatch"  # the caller's buffers are not the value's size: nothing read
    CORRUPT = "corrupt"  # the bytes read fail the value's checksum: a miss, and the key is forgotten
    IO_ERROR = "io_error"  # the read itself failed


class Recovery(NamedTuple):
    """What opening a directory found: values and bytes indexed again, files kept, index tails cut, time taken."""

    blocks: int
    bytes: int
    files: int
    cut_tails: int
    seconds: float


@dataclass
class DiskStats:
    """Counters since open (monotonic) and what the tier holds now."""

    blocks: int = 0
    bytes: int = 0
    files: int = 0
    queued_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    corrupt_reads: int = 0
    read_errors: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # values not written, by reason
