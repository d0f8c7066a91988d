"""Mooncake's system libraries (libibverbs and its libnl dependencies), found and preloaded once per process."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from kvsidecar.errors import NativeLibraryError

__all__ = ["NATIVE_DIR_NAME", "ensure_native_libs", "native_dir", "preload_from"]

NATIVE_DIR_NAME = "kvsidecar-native"
IBVERBS = "libibverbs.so.1"
# Dependencies first: the loader resolves a library's DT_NEEDED entries against sonames already in the process.
_PRELOAD_ORDER = ("libnl-3.so.200", "libnl-route-3.so.200", IBVERBS)

_lock = threading.Lock()
# Folders already preloaded into this process; dlopen of the same file again is harmless but not free.
_preloaded: set[Path] = set()


def native_dir(prefix: str | os.PathLike[str] | None = None) -> Path:
    """The folder where scripts/setup.sh unpacks the libraries when it cannot install them system-wide."""
    return Path(sys.prefix if prefix is None else prefix) / "lib" / NATIVE_DIR_NAME


def _system_has_ibverbs() -> bool:
    try:
        ctypes.CDLL(IBVERBS)
    except OSError:
        return False
    return True


def preload_from(folder: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Load the libraries in folder with RTLD_GLOBAL; return the LD_LIBRARY_PATH a child process needs."""
    with _lock:
        if folder not in _preloaded:
            for name in _PRELOAD_ORDER:
                path = folder / name
                # A library missing here may still come from the system; only libibverbs itself is required.
                if not path.exists() and name != IBVERBS:
                    continue
                try:
                    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                except OSError as exc:
                    raise NativeLibraryError(f"cannot load {path}: {exc}") from exc
            _preloaded.add(folder)
    env = os.environ if environ is None else environ
    inherited = env.get("LD_LIBRARY_PATH", "")
    return {"LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(folder), inherited) if p)}


def ensure_native_libs(
    prefix: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Make libibverbs loadable in this process; return the environment additions a child process needs."""
    folder = native_dir(prefix)
    with _lock:
        preloaded = folder in _preloaded
    # Once our copy is loaded, a probe by soname finds it too, so ask about the folder first to stay idempotent.
    if not preloaded and _system_has_ibverbs():
        return {}
    if not preloaded and not (folder / IBVERBS).exists():
        raise NativeLibraryError(
            f"{IBVERBS} is not installed and {folder} does not hold it: install libibverbs1 "
            "(apt-get install libibverbs1) or run scripts/setup.sh"
        )
    return preload_from(folder, environ)
