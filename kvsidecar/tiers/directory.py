"""The --ssd-dir owner lock: one daemon per directory, two writers would corrupt each other's segment files.

The kernel drops an flock however its holder dies, so a crash never blocks the restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvsidecar.errors import DiskDirBusy

__all__ = ["LOCK_NAME", "SsdDirLock"]

LOCK_NAME = "kvsidecar.lock"


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
        """Create the directory if needed and lock it; raise DiskDirBusy naming the live owner."""
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskDirBusy(f"cannot create ssd-dir {path}: {exc.strerror}") from None
        lock_path = path / LOCK_NAME
        last_alive = lock_path.stat().st_mtime if lock_path.exists() else None
        try:
            f = lock_path.open("a+")
        except OSError as exc:
            raise DiskDirBusy(f"cannot open {lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise DiskDirBusy(
                f"ssd-dir {path} is in use by another running kvsidecar ({owner}); each daemon needs its own "
                "directory (two writers corrupt each other's segment files)"
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
