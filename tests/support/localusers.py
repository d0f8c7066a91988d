"""Throwaway local accounts for tests that act as other uids on this node (root only; CI runs as root)."""

from __future__ import annotations

import contextlib
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["shared_dir", "throwaway_users"]


@contextlib.contextmanager
def throwaway_users(count: int, prefix: str) -> Iterator[list[pwd.struct_passwd]]:
    """count system users named prefix + random hex (no home, no shell), removed at the end."""
    made: list[str] = []
    try:
        for _ in range(count):
            name = f"{prefix}{secrets.token_hex(3)}"
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True, timeout=30)  # fmt: skip
            made.append(name)
        yield [pwd.getpwnam(n) for n in made]
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=30)


@contextlib.contextmanager
def shared_dir(prefix: str, mode: int) -> Iterator[Path]:
    """A directory under /tmp with the given mode, which other uids can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(mode)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
