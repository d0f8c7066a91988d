"""Block hashes kept as one bytes object: a long prompt's lookup parses one field, not one object per hash.

A 128k-token prompt is 8192 hashes. As a repeated protobuf field they cost the client ~0.85 ms to build, the daemon
~0.5 ms to turn into a list and another pass to check their lengths, before a single key is probed; a miss probes
the first few dozen. Packed, the daemon checks one length and turns into objects only the hashes a stage probes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import overload

__all__ = ["PackedHashes"]


class PackedHashes(Sequence[bytes]):
    """Hashes of `width` bytes each, back to back in `data`; indexing gives bytes, slicing another PackedHashes."""

    __slots__ = ("data", "width")

    def __init__(self, data: bytes, width: int) -> None:
        if width < 1:
            raise ValueError(f"a hash is at least 1 byte wide, got {width}")
        if len(data) % width:
            raise ValueError(f"{len(data)} bytes are not a whole number of {width}-byte hashes")
        self.data, self.width = bytes(data), width

    @classmethod
    def of(cls, hashes: Sequence[bytes], width: int) -> PackedHashes:
        """Pack hashes that are each exactly width bytes (ValueError names the first that is not)."""
        data = b"".join(hashes)
        # None longer than width and width each on average: all exactly width (one C-level pass, no set built).
        if len(data) != len(hashes) * width or (hashes and max(map(len, hashes)) != width):
            i = next(i for i, h in enumerate(hashes) if len(h) != width)
            raise ValueError(f"block hash {i} has {len(hashes[i])} bytes, the session declared {width}")
        return cls(data, width)

    def __len__(self) -> int:
        return len(self.data) // self.width

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> PackedHashes: ...

    def __getitem__(self, index: int | slice) -> bytes | PackedHashes:
        w = self.width
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return PackedHashes(self.data[start * w : max(start, stop) * w], w)
            return PackedHashes(b"".join(self[i] for i in range(start, stop, step)), w)
        i = operator.index(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"hash index {index} out of range for {len(self)} hashes")
        return self.data[i * w : (i + 1) * w]

    def __iter__(self) -> Iterator[bytes]:
        w = self.width
        return (self.data[i : i + w] for i in range(0, len(self.data), w))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return self.width == other.width and self.data == other.data
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.width, self.data))

    def __repr__(self) -> str:
        return f"PackedHashes({len(self)} hashes of {self.width} bytes)"

    def suffixes(self) -> list[str]:
        """`@<hex>` of every hash (keys.hash_suffixes), from one hex pass over all of them."""
        text = self.data.hex()
        step = 2 * self.width
        return ["@" + text[i : i + step] for i in range(0, len(text), step)]
