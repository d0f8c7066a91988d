"""A save in flight, as the engine sees it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from kvsidecar_client.errors import SidecarError
from kvsidecar_client.results import SaveResult

__all__ = ["SaveJob"]


class SaveJob:
    """A save the daemon is carrying out; until `done()` the daemon may still read the blocks, so do not reuse them.

    A failed save (any SidecarError, including DaemonUnavailable) is also done: the daemon has stopped reading,
    except after DeadlineExceeded, where it may still be copying; keep save deadlines generous for that reason.
    Saves are never cancelled from the client for the same reason.
    """

    __slots__ = ("_future", "_run_here")

    def __init__(
        self, future: concurrent.futures.Future[SaveResult], run_here: Callable[[], object] = lambda: None
    ) -> None:
        """run_here sends the save on the calling thread if no client thread has taken it yet (else does nothing)."""
        self._future = future
        self._run_here = run_here

    def done(self) -> bool:
        """True once the save finished, successfully or not."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait up to `timeout` seconds (None: until done); raise the save's SidecarError, or TimeoutError.

        Waiting with no timeout for a save no client thread has taken yet sends it from this thread: a caller that
        waits at once (SGLang's backend) pays no hand-off to a save thread and back.
        """
        if timeout is None and not self._future.done():
            self._run_here()
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Python 3.10's futures TimeoutError is not the builtin one; give callers a single type to catch.
            raise TimeoutError(f"the save is still in flight after {timeout} s; its blocks are still in use") from None

    def exception(self, timeout: float | None = None) -> SidecarError | None:
        """The save's error, or None when it succeeded; waits like `result`."""
        try:
            error = self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the save is still in flight after {timeout} s; its blocks are still in use") from None
        if error is None or isinstance(error, SidecarError):
            return error
        raise error  # only the client completes these futures: anything else is a client bug, shown as is

    def add_done_callback(self, callback: Callable[[SaveJob], object]) -> None:
        """Call `callback(job)` once the save is done (at once if it already is), on some client thread (or the
        thread that sent it from `result`)."""
        self._future.add_done_callback(lambda _: callback(self))
