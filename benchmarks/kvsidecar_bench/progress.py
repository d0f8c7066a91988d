"""A dependency-free progress bar on stderr: one redrawn line on a terminal, a line per section elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 28


class Progress:
    """Counts work units of a known total; `step(label)` after each one, `section(name)` when a part begins."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self._started = time.monotonic()
        self._section = ""
        self._last = ""

    def section(self, name: str) -> None:
        """A new part of the run begins."""
        self._section = name
        if self.enabled and not self.live:
            print(f"[{self._elapsed()}] {name}", file=self.stream, flush=True)
        self._draw("")

    def step(self, label: str = "", units: int = 1) -> None:
        """`units` of work are done."""
        self.done = min(self.total, self.done + units)
        self._draw(label)

    def note(self, text: str) -> None:
        """A line that stays (a skipped path, a warning), printed above the bar."""
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)
        self._draw(self._last)

    def close(self) -> None:
        """Finish the bar's line."""
        if self.live:
            self.done = self.total
            self._draw("done")
            self.stream.write("\n")
            self.stream.flush()

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self._started)
        return f"{seconds // 60:d}:{seconds % 60:02d}"

    def _draw(self, label: str) -> None:
        self._last = label
        if not self.live:
            return
        filled = round(_WIDTH * self.done / self.total)
        bar = "#" * filled + "." * (_WIDTH - filled)
        pct = 100 * self.done // self.total
        text = f"{self._section}: {label}" if label else self._section
        self.stream.write(f"\r\033[K[{bar}] {pct:3d}% {self._elapsed()} {text}"[:160])
        self.stream.flush()
