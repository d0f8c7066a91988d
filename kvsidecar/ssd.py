"""The --ssd-dir owner lock (SsdDirLock), used by the daemon's own disk tier (kvsidecar/disk).

The rest (Mooncake's offload settings and bucket inventory) served the previous disk tier, Mooncake's SSD offload,
which the daemon no longer enables (docs/ssd-tier.md, "Why not Mooncake's offload"). What was measured of it
(0.3.13, 64 MiB segment, 1 MiB values, loopback):

- The master needs --enable_offload and --offload_on_evict: objects are written to disk when DRAM eviction picks
  them (eager persistence at put time lost keys left in a partly filled bucket, upstream #3006).
- The bucket backend groups evicted objects until a bucket is full before it writes; with its default 256 MiB
  bucket a 64 MiB segment never offloads and puts fail forever. So the bucket is sized from the segment here.
- Offload happens on the owner's heartbeat (MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS, whole seconds): puts into
  a full segment fail with -200 until that round has written the evicted objects out; nothing spills synchronously.
- After a restart the owner scans its directory at setup and re-registers every object with the master (the bucket
  backend; the offset-allocator backend truncates its file). With an external master, an owner restarted within the
  master's --client_ttl recovers nothing, then or later (upstream #3052): the master keeps a key's disk replica of
  the dead owner and drops the new one (AddReplica), then removes the dead owner's replicas, keys and all, when it
  expires that client (ClientMonitorFunc). Waiting a whole TTL once the old owner's client has stopped avoids it.
- Two owners sharing one directory corrupt its buckets: the directory is locked (flock) by its daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

__all__ = [
    "LOCK_NAME",
    "DiskInventory",
    "SsdDirBusy",
    "SsdDirLock",
    "bucket_size_for",
    "inventory",
    "listed_keys",
    "meta_keys",
    "offload_environment",
    "ttl_wait_seconds",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
LOCK_NAME = "kvsidecar.lock"
# A bucket is written once it is this full; it must be a small part of what one eviction round frees (5% of the
# segment by default) or evicted objects wait in DRAM for a bucket that never fills.
_BUCKET_SEGMENT_FRACTION = 32
_MIN_BUCKET = 1 * MiB
_MAX_BUCKET = 256 * MiB  # Mooncake's default
_HEARTBEAT_S = 1  # Mooncake's minimum; its default of 10 s bounds the write rate into a full segment to a tenth
# Extra wait past the master's client TTL: its expiry check runs once a second, and the old process may have
# pinged for a moment after it let go of the lock.
_TTL_MARGIN_S = 4.0
# An owner whose lock file was last touched longer ago than this (plus the TTL) died long ago.
_TOUCH_STALL_S = 30.0


class SsdDirBusy(OSError):
    """The disk-tier directory is locked by another live daemon."""


def bucket_size_for(segment_size: int, buffer_size: int) -> int:
    """Bucket size for a segment: small against one eviction round, and at most half the offload buffer."""
    size = min(_MAX_BUCKET, max(_MIN_BUCKET, segment_size // _BUCKET_SEGMENT_FRACTION), buffer_size // 2)
    return max(size, _MIN_BUCKET)


def offload_environment(directory: str, size: int, buffer_size: int, segment_size: int) -> dict[str, str]:
    """Mooncake's MOONCAKE_OFFLOAD_* variables for a bucket-backend tier of `size` bytes under `directory`."""
    return {
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": directory,
        # The only backend that recovers its objects after a restart.
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(buffer_size),
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(size),
        # Logical and on-disk caps; the oldest buckets go first when either would be exceeded.
        "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(size),
        "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES": str(size),
        "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "fifo",
        "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(bucket_size_for(segment_size, buffer_size)),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(_HEARTBEAT_S),
    }


def ttl_wait_seconds(last_alive: float | None, stopped: float | None, client_ttl_s: float, now: float) -> float:
    """How long a new owner must wait before mounting so the master has forgotten the old one (upstream #3052).

    The old owner's Mooncake client pings the master from its own threads until its process is gone, which can be
    after its last recorded sign of life, even after a clean stop (the native client tears down at exit). The lock
    is free, so that process is gone now at the latest: a recent owner means a whole TTL (plus margin) from now.
    """
    seen = max((t for t in (last_alive, stopped) if t is not None), default=None)
    if client_ttl_s <= 0 or seen is None or now - seen > client_ttl_s + _TTL_MARGIN_S + _TOUCH_STALL_S:
        return 0.0
    return client_ttl_s + _TTL_MARGIN_S


class DiskInventory(NamedTuple):
    """What a disk-tier directory holds: bucket files, the keys their metadata lists, and bytes on disk."""

    buckets: int
    keys: int
    bytes: int


def inventory(directory: str | os.PathLike[str]) -> DiskInventory:
    """Count the buckets, keys and bytes (allocated blocks) under directory; unreadable metadata counts no keys."""
    buckets = keys = used = 0
    for entry in _entries(Path(directory)):
        try:
            st = entry.stat()
        except OSError:
            continue  # evicted meanwhile
        used += st.st_blocks * 512
        if entry.name.endswith(".bucket"):
            buckets += 1
        elif entry.name.endswith(".meta"):
            with contextlib.suppress(OSError, ValueError):
                keys += _meta_key_count(Path(entry.path).read_bytes())
    return DiskInventory(buckets, keys, used)


def _entries(directory: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            yield from (e for e in it if e.is_file(follow_symlinks=False))
    except OSError:
        return


def _meta_key_count(data: bytes) -> int:
    return len(meta_keys(data))


def meta_keys(data: bytes) -> list[str]:
    """Keys listed in one bucket's .meta file: a protobuf message whose field 2 repeats tenant NUL key per key."""
    pos, keys = 0, []
    while pos < len(data):
        tag, pos = _varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            if field == 2:
                keys.append(data[pos : pos + length].decode("utf-8", "replace").rpartition("\0")[2])
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated metadata")
    return keys


def listed_keys(directory: str | os.PathLike[str], limit: int) -> list[str]:
    """Up to limit keys the directory's bucket metadata lists."""
    keys: list[str] = []
    for entry in _entries(Path(directory)):
        if entry.name.endswith(".meta") and len(keys) < limit:
            with contextlib.suppress(OSError, ValueError):
                keys += meta_keys(Path(entry.path).read_bytes())
    return keys[:limit]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


@dataclass
class SsdDirLock:
    """An exclusive flock on DIR/kvsidecar.lock, held while the daemon runs; the file says who holds it.

    The kernel drops the lock when the process dies, however it dies, so a stale file never blocks a restart. Its
    mtime is refreshed by touch() while the daemon runs, so the next owner knows when the last one was last alive.
    """

    directory: Path
    file: IO[str]
    last_alive: float | None  # the previous owner's last sign of life, None for a fresh directory
    stopped: float | None  # when the previous owner stopped cleanly; None if it was killed (or never ran)

    @classmethod
    def claim(cls, directory: str | os.PathLike[str]) -> SsdDirLock:
        """Create the directory if needed and lock it; raise SsdDirBusy naming the live owner."""
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SsdDirBusy(f"cannot create ssd-dir {path}: {exc.strerror}") from None
        lock_path = path / LOCK_NAME
        last_alive = lock_path.stat().st_mtime if lock_path.exists() else None
        try:
            f = lock_path.open("a+")
        except OSError as exc:
            raise SsdDirBusy(f"cannot open {lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise SsdDirBusy(
                f"ssd-dir {path} is in use by another running kvsidecar ({owner}); each daemon needs its own "
                "directory (two owners corrupt each other's buckets)"
            ) from None
        f.seek(0)
        stopped = _stopped_at(f.read())
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "started": time.time()}) + "\n")
        f.flush()
        return cls(path, f, last_alive, stopped)

    def touch(self) -> None:
        """Record that the owner is alive now."""
        with contextlib.suppress(OSError, ValueError):
            os.utime(self.file.fileno())

    def release(self) -> None:
        """Record the stop time (after the store is closed) and drop the lock."""
        if self.file.closed:
            return
        with contextlib.suppress(OSError, ValueError):
            self.file.seek(0)
            self.file.truncate()
            self.file.write(json.dumps({"pid": os.getpid(), "stopped": time.time()}) + "\n")
            self.file.flush()
        self.touch()
        self.file.close()


def _stopped_at(text: str) -> float | None:
    try:
        stopped = json.loads(text).get("stopped")
    except (ValueError, AttributeError):
        return None
    return float(stopped) if isinstance(stopped, (int, float)) else None
