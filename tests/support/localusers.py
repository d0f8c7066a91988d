"""Throwaway local accounts for tests that act as other uids on this node (root only; CI runs as root).

A process that drops to a throwaway account keeps importing after the drop (grpc imports `grpc._channel` on its first
channel), so the account must reach this checkout, its venv and its interpreter. In a private checkout (under a
directory others may not enter, as root's own home is) it cannot; `for_other_accounts` then starts the process in a
mount namespace of its own where each such directory is a tmpfs (mode 0755) holding only the paths the process needs,
bound to the real ones: nothing else of that directory shows, and nothing changes outside that process.

Run as a script, this module is that start: `localusers.py PLAN -- ARGV...` (PLAN from `for_other_accounts`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

__all__ = ["for_other_accounts", "other_accounts", "shared_dir", "throwaway_users", "why_other_accounts_cannot_run"]

ROOT = Path(__file__).resolve().parents[2]


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
def other_accounts(count: int, prefix: str) -> Iterator[list[pwd.struct_passwd]]:
    """throwaway_users that can run this checkout's engine code; the calling test skips, saying why, where they
    cannot (a module fixture's users, shared by its tests)."""
    import pytest

    with throwaway_users(count, prefix) as made:
        why = why_other_accounts_cannot_run(made[0])
        if why:
            pytest.skip(why)
        yield made


@contextlib.contextmanager
def shared_dir(prefix: str, mode: int) -> Iterator[Path]:
    """A directory under /tmp with the given mode, which other uids can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(mode)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _searchable_by_others(path: Path) -> bool:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _needed() -> list[Path]:
    """What a test process run by this interpreter reads: the checkout, the venv, the interpreter and sys.path."""
    found = [ROOT, Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent]
    found += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    # Both the path as written and the one symlinks lead to: either may be how a module is found.
    return sorted({q for p in found for q in (p.absolute(), Path(os.path.realpath(p)))})


def _top_blocked(path: Path) -> Path | None:
    """The highest directory above path that other accounts may not enter, or None."""
    return next((d for d in reversed(path.parents) if not _searchable_by_others(d)), None)


@cache
def _plan(needed: tuple[Path, ...]) -> dict[str, list[str]]:
    """{directory others may not enter: [the needed paths under it to bind into its stand-in]}, outermost only."""
    plan: dict[str, list[str]] = {}
    for path in needed:
        top = _top_blocked(path)
        if top is not None:
            plan.setdefault(str(top), []).append(str(path))
    for top, paths in plan.items():
        plan[top] = [p for p in paths if not any(Path(p).is_relative_to(q) and p != q for q in paths)]
    return plan


def for_other_accounts(argv: Sequence[str], also: Sequence[Path] = ()) -> list[str]:
    """argv, started (as root) so that it can still read what it imports, and the directories also names, after it
    drops to a throwaway account."""
    plan = _plan((*_needed(), *also))
    if not plan:
        return list(argv)
    return ["unshare", "--mount", "--propagation", "private", "--", sys.executable, str(Path(__file__)),
            json.dumps(plan), "--", *argv]  # fmt: skip


# Drops to the account first, then imports what an engine imports: any of it the account cannot read fails here.
_PROBE = """
import os, sys
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
import grpc, grpc._channel, torch, kvsidecar_client, kvsidecar_contract
"""


def why_other_accounts_cannot_run(user: pwd.struct_passwd) -> str:
    """One line saying why a process dropped to user cannot import this checkout's engine code, or "" if it can."""
    # A directory the process needs that is itself private cannot be lent: its bound copy keeps its mode.
    private = [p for p in _needed() if not _searchable_by_others(p)]
    if private:
        return f"other accounts cannot enter {private[0]} (mode {stat.filemode(os.stat(private[0]).st_mode)})"
    argv = for_other_accounts([sys.executable, "-c", _PROBE, str(user.pw_uid), str(user.pw_gid)])
    probe = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return ""
    last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
    blocked = ", ".join(_plan(tuple(_needed()))) or "none"
    return f"account {user.pw_name} cannot import the engine's code (private directories: {blocked}): {last}"


def _enter(plan: dict[str, list[str]], argv: list[str]) -> None:
    """In a fresh mount namespace: each blocked directory becomes a tmpfs holding only its needed paths; exec argv."""
    libc = ctypes.CDLL(None, use_errno=True)
    ms_bind, ms_rec = 4096, 16384

    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        args = [s.encode() if s is not None else None for s in (source, target, fstype)]
        if libc.mount(*args, flags, data.encode() if data is not None else None) != 0:
            errno = ctypes.get_errno()
            sys.exit(f"cannot mount {source} on {target} for another account: {os.strerror(errno)}")

    # Held open before the tmpfs hides them; /proc/self/fd/N then names each real directory.
    held = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for paths in plan.values() for path in paths}
    umask = os.umask(0o022)  # the stand-in directories are 0755 whatever root's umask
    for top, paths in plan.items():
        mount("kvsidecar-test", top, "tmpfs", 0, "mode=0755")
        for path in paths:
            os.makedirs(path, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{held[path]}", path, None, ms_bind | ms_rec, None)
    os.umask(umask)
    for fd in held.values():
        os.close(fd)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    plan_text, dashes, *command = sys.argv[1:]
    if dashes != "--" or not command:
        sys.exit("usage: localusers.py PLAN -- ARGV...")
    _enter(json.loads(plan_text), command)
