"""One engine rank in its own OS process, driven over a pipe: the one rank-process driver of tests and the bench.

The parent spawns a process (multiprocessing, spawn: nothing of the parent's threads or locks comes along) that
builds `factory(*args)` and then runs one method of it per command, `(op, kwargs)`, replying with its return value.
What a rank does (its tensors, its clients, which bytes it writes and checks) is the factory's business; this
module only starts, talks to and stops the process. Output the rank writes (native code too) goes to its log file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "RankDied", "RankError", "RankProcess", "each"]

DEFAULT_TIMEOUT = 60.0
_POLL_S = 0.2  # how often a wait for an answer checks that the process still lives


class RankError(RuntimeError):
    """A command failed inside the rank process; carries its traceback and the exception's type name."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


class RankDied(RankError):
    """The rank process is gone (killed by a fault, or crashed)."""


class RankProcess:
    """The parent's handle on one rank process."""

    def __init__(self, factory: Callable[..., Any], *args: Any, name: str, log_path: Path | None = None) -> None:
        self.factory, self.args, self.name = factory, args, name
        self.log_path = log_path
        self.proc: Any = None
        self.conn: Connection | None = None
        self.ready_info: Any = None
        self.starts = 0

    def spawn(self) -> RankProcess:
        """Start the process; `wait_ready` before the first command (spawn many, then wait for all)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_rank_main, args=(child, self.factory, self.args, self.log_path), name=self.name, daemon=True
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self.starts += 1
        return self

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT) -> RankProcess:
        """Wait until the factory has built the rank; what it returned for `ready` is in ready_info."""
        self.ready_info = self.receive(timeout)
        return self

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> RankProcess:
        """spawn() and wait_ready()."""
        return self.spawn().wait_ready(timeout)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def send(self, op: str, **kwargs: Any) -> None:
        """Send one command without waiting for its answer."""
        assert self.conn is not None
        try:
            self.conn.send((op, kwargs))
        except (BrokenPipeError, OSError) as exc:
            raise RankDied(f"{self.name}: {exc}") from None

    def receive(self, timeout: float = DEFAULT_TIMEOUT) -> Any:
        """The answer to the oldest command sent; RankError if it failed there, RankDied if the process is gone."""
        assert self.conn is not None
        waited = 0.0
        while True:
            try:
                if self.conn.poll(_POLL_S):
                    kind, value, error_type = self.conn.recv()
                    if kind == "error":
                        raise RankError(f"{self.name} (pid {self.pid}): {value}", error_type)
                    return value
            except (EOFError, OSError) as exc:
                raise RankDied(f"{self.name}: {exc}\n{self.log()}") from None
            if not self.alive():
                raise RankDied(f"{self.name} exited with {self.proc.exitcode}:\n{self.log()}")
            waited += _POLL_S
            if waited >= timeout:
                raise TimeoutError(f"{self.name} (pid {self.pid}) silent for {timeout} s\n{self.log()}")

    def call(self, op: str, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Any:
        """Run one command and return its answer."""
        self.send(op, **kwargs)
        return self.receive(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the rank to exit (its `exit` method runs first, if it has one), then make sure the process is gone."""
        if self.alive():
            with contextlib.suppress(RankError, TimeoutError):
                self.call("exit", timeout=timeout)
            self.proc.join(timeout)
        if self.alive():
            self.proc.kill()
            self.proc.join(10)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def log(self) -> str:
        """What the process wrote."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-4000:]


def each(
    procs: Sequence[RankProcess], op: str, args: Sequence[dict[str, Any]], timeout: float = DEFAULT_TIMEOUT
) -> list[Any]:
    """Send op to every process at once (args[i] to procs[i]), so they reach the daemon concurrently, as an
    engine's ranks do; then collect every answer in order, raising the first failure after all have answered."""
    for proc, kw in zip(procs, args, strict=True):
        proc.send(op, **kw)
    answers: list[Any] = []
    first_error: RankError | None = None
    for proc in procs:
        try:
            answers.append(proc.receive(timeout))
        except RankError as exc:  # collect the others' answers first, so the pipes stay in step
            answers.append(None)
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return answers


def _rank_main(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...], log_path: Path | None) -> None:
    """The process: build the rank, answer `ready`, then serve commands until `exit` or the end of the pipe."""
    if log_path is not None:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared; tensors here are tiny
    try:
        rank = factory(*args)
        ready = rank.ready() if hasattr(rank, "ready") else os.getpid()
    except Exception as exc:
        conn.send(("error", traceback.format_exc(), type(exc).__name__))
        return
    conn.send(("ok", ready, ""))
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:
            return
        try:
            method = getattr(rank, op, None) if op == "exit" else getattr(rank, op)
            conn.send(("ok", None if method is None else method(**kwargs), ""))
        except Exception as exc:
            conn.send(("error", f"{op}: {traceback.format_exc()}", type(exc).__name__))
        if op == "exit":
            sys.stdout.flush()
            return
