"""Whether the disk tier writes: an episode of failed writes (a full filesystem, a failing disk) told once.

The first failure of an episode is logged as one warning, with its reason; later ones are only counted (per value, by
the engine), and a new file is tried at most once per RETRY_S meanwhile, so a full filesystem is not asked again for
every value. The first write that lands ends the episode with one line. `problem()` says what operators see in
`kvsidecar status` and the disk tier's health while it lasts.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

__all__ = ["RETRY_S", "Writing"]

log = logging.getLogger("kvsidecar")

RETRY_S = 1.0


class Writing:
    """The write state of one tier's directory; the engine calls it under its lock."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._directory = directory
        self._clock = clock
        self._reason = ""  # "" while writing
        self._since = 0.0
        self._next_try = 0.0
        self._skipped = 0

    def failed(self, exc: OSError, what: str, values: int) -> str:
        """A write (what) failed with exc, costing values; the first failure of an episode is logged. The reason the
        values are skipped for: no_space (a full filesystem or quota) or io_error."""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self._record(f"the filesystem is full ({exc.strerror})" if full else f"{what}: {exc.strerror or exc}", values)
        return "no_space" if full else "io_error"

    def _record(self, reason: str, values: int) -> None:
        now = self._clock()
        self._next_try = now + RETRY_S
        self._skipped += values
        if self._reason:
            return
        self._reason, self._since = reason, now
        log.warning(
            "disk tier %s: not writing: %s; saves go to DRAM alone until it writes again (values not written are "
            "counted in kvsidecar_disk_tier_skipped_writes_total)",
            self._directory,
            reason,
        )

    def missed(self, values: int) -> None:
        """Values not written because no file was tried (between tries of an episode)."""
        self._skipped += values

    def wrote(self) -> None:
        """A write landed: an episode ends with one line."""
        if not self._reason:
            return
        log.info(
            "disk tier %s: writing again after %.1f s (%s); %d values were not written meanwhile",
            self._directory,
            self._clock() - self._since,
            self._reason,
            self._skipped,
        )
        self._reason, self._skipped = "", 0

    def may_try(self) -> bool:
        """Whether a new file may be tried now (during an episode, once per RETRY_S; else `missed`)."""
        return not self._reason or self._clock() >= self._next_try

    def problem(self) -> str:
        """ "" while writing; else why not, since when, and what it cost so far."""
        if not self._reason:
            return ""
        return (
            f"disk tier NOT WRITING for {self._clock() - self._since:.0f} s: {self._reason} "
            f"({self._skipped} values not written)"
        )
