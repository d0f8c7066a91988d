"""Mooncake's environment for the processes a test or bench starts: loopback, quiet logs, libibverbs, a private tmp.

Mooncake's processes read their own environment at setup, so it is set at this edge. TMPDIR (and TMP, TEMP,
TEMPDIR, the names libstdc++'s temp_directory_path and Go's os.TempDir read) points at a private folder that is
removed at close, so nothing a Mooncake process leaves in its temporary directory outlives the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CLIENT_ENV", "MooncakeEnv"]

CLIENT_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # else the client advertises eth0 and leaves loopback
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # a missing master fails setup in ~4 s instead of ~90 s
}
_TMP_NAMES = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")


class MooncakeEnv:
    """The variables every Mooncake process of a run gets, and the private temporary folder they name."""

    def __init__(self, parent: str | os.PathLike[str] | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvsidecar-mooncake-", dir=parent))

    def variables(self, *, native: bool = True) -> dict[str, str]:
        """CLIENT_ENV, the private temporary folder and (`native`) where libibverbs is, if the system has none.

        The daemon finds libibverbs itself (kvsidecar.store.native); Mooncake's own binaries need to be told.
        """
        out = {**CLIENT_ENV, **dict.fromkeys(_TMP_NAMES, str(self.tmp))}
        if native:
            from kvsidecar.store.native import ensure_native_libs

            out.update(ensure_native_libs())
        return out

    def child_env(self, extra: Mapping[str, str] | None = None, *, native: bool = True) -> dict[str, str]:
        """This process's environment plus variables() plus `extra`, for a child process."""
        return {**os.environ, **self.variables(native=native), **(extra or {})}

    def leftovers(self) -> list[str]:
        """What the processes left in the private folder so far."""
        return sorted(os.listdir(self.tmp)) if self.tmp.exists() else []

    def close(self) -> list[str]:
        """Remove the private folder; return what was left in it."""
        left = self.leftovers()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return left

    def __enter__(self) -> MooncakeEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
