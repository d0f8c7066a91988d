"""The index log's records: one per value written (key, offset, length, value checksum) or removed.

Each segment file NNNNNNNN.seg has an index NNNNNNNN.idx next to it. A record is appended only after its value's
bytes are durable, and carries a checksum of itself, so a torn or corrupted tail is recognised and cut at recovery.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

__all__ = [
    "DELETE",
    "MAX_KEY_BYTES",
    "PUT",
    "Record",
    "decode",
    "decode_raw",
    "encode",
    "indexed_keys",
    "segment_numbers",
    "value_checksum",
]

PUT, DELETE = 1, 2
_MAGIC = 0x4B56_4458  # "KVDX"
# magic, kind, key length, offset, length, value checksum; then the key; then the record's own checksum.
_HEAD = struct.Struct("<IBHQQQ")
_TAIL = struct.Struct("<Q")
MAX_KEY_BYTES = 0xFFFF
_SEGMENT = re.compile(r"^(\d{8})\.seg$")


class Record(NamedTuple):
    """One index entry: where key's value lies in this segment, or (DELETE) that key is gone."""

    kind: int
    key: str
    offset: int
    length: int
    checksum: int


def value_checksum(parts: Iterator[memoryview] | list[memoryview]) -> int:
    """The checksum a value's bytes (given in order, in parts) are stored and verified with."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def encode(record: Record) -> bytes:
    """The record's bytes in the index file."""
    key = record.key.encode()
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    body = _HEAD.pack(_MAGIC, record.kind, len(key), record.offset, record.length, record.checksum) + key
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes) -> tuple[list[Record], int]:
    """The whole records at the start of data, and how many bytes they take: a torn or bad record ends the log."""
    raw, good = decode_raw(data)
    return [Record._make(r) for r in raw], good


def decode_raw(data: bytes) -> tuple[list[tuple[int, str, int, int, int]], int]:
    """decode() as plain tuples (kind, key, offset, length, checksum): recovery replays millions of them."""
    records, pos, end_of_data = [], 0, len(data)
    unpack, head, tail, digest = _HEAD.unpack_from, _HEAD.size, _TAIL.size, xxhash.xxh3_64_intdigest
    while pos + head <= end_of_data:
        magic, kind, key_len, offset, length, checksum = unpack(data, pos)
        end = pos + head + key_len
        if magic != _MAGIC or kind not in (PUT, DELETE) or end + tail > end_of_data:
            break
        body = data[pos:end]
        if _TAIL.unpack_from(data, end)[0] != digest(body):
            break
        try:
            key = body[head:].decode()
        except UnicodeDecodeError:
            break
        records.append((kind, key, offset, length, checksum))
        pos = end + tail
    return records, pos


def segment_numbers(directory: str | os.PathLike[str]) -> list[int]:
    """The numbers of the segment files in directory, oldest first."""
    return sorted(int(m.group(1)) for p in Path(directory).iterdir() if (m := _SEGMENT.match(p.name)) is not None)


def indexed_keys(directory: str | os.PathLike[str]) -> list[str]:
    """The keys the directory's index files name now (read only, not checked against the data): for inspection."""
    keys: dict[str, None] = {}
    for number in segment_numbers(directory):
        try:
            data = (Path(directory) / f"{number:08d}.idx").read_bytes()
        except FileNotFoundError:
            continue
        for r in decode(data)[0]:
            if r.kind == PUT:
                keys[r.key] = None
            else:
                keys.pop(r.key, None)
    return list(keys)
