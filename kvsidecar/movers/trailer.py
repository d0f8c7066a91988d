"""The checksum trailer some stored values end with, and which values carry one (docs/values.md, checksums).

A value whose key is chosen is the block's bytes (memory/regions.py) followed by TRAILER_BYTES of trailer:

    offset 0  4 bytes  MAGIC, b"kvsT"
    offset 4  1 byte   the algorithm: XXH3 (1: xxh3-64 over the key's UTF-8, then the value's bytes)
    offset 5  3 bytes  zero
    offset 8  8 bytes  the sum, little-endian

Any other trailer (another writer's bytes, a torn or flipped trailer) fails its value's check: never served. The key
is summed with the bytes, so a value served under another key (a mix-up, a copy into the wrong place) fails too.

Which keys are chosen is a rule of the value format, the same for every writer and reader of a key: one key in
`checksum_every` (the keys whose xxh3-64 is a multiple of it; 1: every key, 0: none). The rule is part of the
value id (Layout.checksum_every, set by the daemon from --checksums), so a reader knows from the key alone whether
its value has a trailer, and values of other rules (or from before checksums) are under other keys. Only chosen
values carry a trailer: Mooncake's allocator rounds every object up to a size class (3 mantissa bits), so 16 more
bytes on a power-of-two value take 12.5% more of the segment.

Pure: bytes in, bytes and booleans out.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvsidecar_contract.placement import DEFAULT_CHECKSUM_EVERY

__all__ = [
    "ChecksumSettings",
    "MAGIC",
    "MODES",
    "TRAILER_BYTES",
    "XXH3",
    "chosen",
    "digest",
    "sealed",
    "stored_bytes",
    "verdict",
]

TRAILER_BYTES = 16
MAGIC = b"kvsT"
XXH3 = 1
MODES = ("off", "sampled", "all")
_FORMAT = struct.Struct("<4sB3xQ")


@dataclass(frozen=True)
class ChecksumSettings:
    """A daemon's --checksums: none (off), one value in `every` chosen by key (sampled), or every value (all)."""

    mode: str = "sampled"
    every: int = DEFAULT_CHECKSUM_EVERY

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"checksums must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"checksum-every must be >= 1, got {self.every}")

    @property
    def checksum_every(self) -> int:
        """The rule as the value id holds it (Layout.checksum_every): one key in N, 1 every key, 0 none."""
        return {"off": 0, "all": 1}.get(self.mode, self.every)


def stored_bytes(key: str, value_bytes: int, checksum_every: int) -> int:
    """What the store holds for a value of value_bytes under key: the value, and its trailer where the rule chose it."""
    return value_bytes + (TRAILER_BYTES if chosen(key, checksum_every) else 0)


def chosen(key: str, checksum_every: int) -> bool:
    """Whether the value of key carries a checksum trailer under the rule checksum_every."""
    if checksum_every <= 1:
        return checksum_every == 1
    return xxhash.xxh3_64_intdigest(key.encode()) % checksum_every == 0


def digest(key: str, parts: Iterable[memoryview]) -> int:
    """The sum of a value under key, its bytes given in order in parts (the hash releases the GIL as it runs)."""
    h = xxhash.xxh3_64(key.encode())
    for part in parts:
        h.update(part)
    return h.intdigest()


def sealed(total: int) -> bytes:
    """The trailer of a value whose sum is total."""
    return _FORMAT.pack(MAGIC, XXH3, total)


def verdict(trailer: bytes | memoryview, summed: int) -> bool:
    """Whether a value with this trailer may be served: a trailer of ours whose sum is summed, the sum of the bytes
    read."""
    return len(trailer) == TRAILER_BYTES and bytes(trailer) == sealed(summed)
