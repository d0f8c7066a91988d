"""SIGTERM and SIGINT on the daemon's event loop (the main thread): they ask the daemon to stop, also while it starts.

Mooncake's setup holds the GIL for as long as it runs (seconds; 90 s without a master): no Python runs meanwhile,
not even a signal handler. Around such a call (`fatal`) the two signals end the process at once instead, as their
default action: nothing the daemon started needs more (the embedded master is told to stop by the kernel, locks
are dropped with the process, and nothing is listening yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

__all__ = ["STOP_SIGNALS", "Signals", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Signals:
    """No signal handling of the daemon's own (a daemon in a thread of a test process): `fatal` changes nothing."""

    received = ""  # the name of the stop signal heard, "" for none

    @contextlib.contextmanager
    def fatal(self) -> Iterator[None]:
        """Around a call no Python runs during: a stop signal ends the process (here: as it would anyway)."""
        yield


class StopSignals(Signals):
    """SIGTERM and SIGINT call on_stop on the loop; around `fatal` they end the process instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_stop: Callable[[], None]) -> None:
        self._loop = loop
        self._on_stop = on_stop
        self._install()

    def _install(self) -> None:
        for sig in STOP_SIGNALS:
            self._loop.add_signal_handler(sig, self._heard, sig)

    def _heard(self, sig: int) -> None:
        self.received = signal.Signals(sig).name
        self._on_stop()

    @contextlib.contextmanager
    def fatal(self) -> Iterator[None]:
        """SIGTERM and SIGINT take their default action (the process ends) until the block is left."""
        for sig in STOP_SIGNALS:
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_DFL)
        try:
            yield
        finally:
            self._install()
