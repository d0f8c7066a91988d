"""The daemon in a thread of the test process, over a real socket, with a store the test passes in."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvsidecar.config import Config, settings_of
from kvsidecar.daemon.process import Daemon


class InProcessDaemon:
    """Start with a store (e.g. MemoryStore with faults), stop when done; `target` is its socket."""

    def __init__(self, workdir: Path, store: Any, **settings: Any) -> None:
        self.config = Config(socket=str(workdir / "d.sock"), metrics_address="127.0.0.1:0", **settings)
        self.store = store
        self.registry = CollectorRegistry(auto_describe=True)
        self.daemon: Daemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def target(self) -> str:
        """The gRPC target of the socket."""
        return f"unix://{self.config.socket}"

    def start(self) -> InProcessDaemon:
        """Start and wait until serving."""
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Stop gracefully and join the thread."""
        if self._loop is not None and self._stop is not None:
            # A closed loop: a start that failed has ended the thread already.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The current value of one metric sample."""
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.daemon = Daemon(settings_of(self.config), store=self.store, registry=self.registry)
        try:
            await self.daemon.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.daemon.stop()
