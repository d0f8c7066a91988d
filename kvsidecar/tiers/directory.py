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
# Beyond the master's client TTL: the owner's last sign of life may be a housekeeping tick older than its last
# heartbeat to the master, and the master checks client TTLs on a loop of its own.
_TTL_SLACK_S = 3.0


@dataclass
class SsdDirLock:
    """An exclusive flock on DIR/kvsidecar.lock, held while the daemon runs; the file says who holds it.

    The kernel drops the lock when the process dies, however it dies, so a stale file never blocks a restart. Its
    mtime is refreshed by touch() while the daemon runs, so the next owner knows when the last one was last alive;
    the file also names the external master the owner used and until when that master may list a segment of an
    earlier owner that was killed (see dead_segment_until), so the next owner knows it too, however the last one
    ended.
    """

    directory: Path
    file: IO[str]
    last_alive: float | None  # the previous owner's last sign of life, None for a fresh directory
    stopped: float | None  # when the previous owner stopped cleanly; None if it was killed (or never ran)
    previous_master: str = ""  # the external master the previous owner used ("" embedded, or unknown)
    master: str = ""  # the external master this owner uses ("" embedded)
    previous_dead_until: float = 0.0  # what the previous owner recorded as dead_segment_until (wall clock)
    dead_until: float = 0.0  # this owner's dead_segment_until, recorded in the file

    @classmethod
    def claim(cls, directory: str | os.PathLike[str], *, master: str = "") -> SsdDirLock:
        """Create the directory if needed and lock it; raise DiskDirBusy naming the live owner. master: the external
        master this owner uses ("" for an embedded one), written down for the next owner."""
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
        previous = _record(f.read())
        lock = cls(
            path,
            f,
            last_alive,
            _number(previous.get("stopped")),
            _text(previous.get("master")),
            master,
            _number(previous.get("dead_segment_until")) or 0.0,
        )
        lock._write(started=time.time())
        return lock

    def dead_segment_until(self, client_ttl: float) -> float:
        """Until when (wall clock; 0 for never) the external master this owner uses may still list a segment of an
        earlier owner of this directory that was killed: nobody serves it, and reads the master routes there fail.

        The master forgets a client client_ttl seconds after its last heartbeat; the previous owner's last sign of
        life (the lock's mtime) is at most a housekeeping tick older than its last heartbeat. An owner that stopped
        cleanly unmounted its own segment, but passes on what it knew of an earlier killed one.
        """
        if not self.master or self.previous_master != self.master:
            return 0.0  # an embedded master dies with its daemon; another master never listed these segments
        until = self.previous_dead_until
        if self.last_alive is not None and self.stopped is None:
            until = max(until, self.last_alive + client_ttl + _TTL_SLACK_S)
        return until

    def record_dead_until(self, until: float) -> None:
        """Write down dead_segment_until's answer for the next owner (who may come before it passes)."""
        self.dead_until = until
        self._write(started=time.time())

    def touch(self) -> None:
        """Record that the owner is alive now."""
        with contextlib.suppress(OSError, ValueError):
            os.utime(self.file.fileno())

    def release(self) -> None:
        """Record the stop time (after the store is closed) and drop the lock."""
        if self.file.closed:
            return
        self._write(stopped=time.time())
        self.touch()
        self.file.close()

    def _write(self, **when: float) -> None:
        record: dict[str, object] = {"pid": os.getpid(), **when, "master": self.master}
        if self.dead_until:
            record["dead_segment_until"] = self.dead_until
        with contextlib.suppress(OSError, ValueError):
            self.file.seek(0)
            self.file.truncate()
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def _record(text: str) -> dict[str, object]:
    """What the previous owner wrote ({} when unreadable)."""
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""
