"""Processes of a simulated cluster: daemons (optionally inside a namespace) and what their sockets look like."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from netns import Node

from kvsidecar.fence import guard, proctcp

_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 share the number (asm-generic)
_libc = ctypes.CDLL(None, use_errno=True)
KVSIDECAR = [sys.executable, "-m", "kvsidecar"]


def steal_fd(pid: int, fd: int) -> socket.socket:
    """A duplicate of another process's socket (pidfd_getfd; root may do this to any process)."""
    pidfd = os.pidfd_open(pid)
    try:
        copy = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd({pid}, {fd}): {os.strerror(err)}")
        return socket.socket(fileno=copy)
    finally:
        os.close(pidfd)


def listener_filters(pid: int) -> list[tuple[proctcp.TcpSocket, bytes]]:
    """Every TCP listener of pid with the BPF program attached to it (b'' for none), seen from outside."""
    out = []
    for s, fd in proctcp.listeners(pid):
        with steal_fd(pid, fd) as sock:
            out.append((s, guard.attached_filter(sock)))
    return out


class NamespaceOf(Node):
    """The network namespace a process lives in (a daemon's private one: its loopback guard), entered by nsenter."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"pid {pid}", "")
        self.pid = pid

    def command(self, argv):  # type: ignore[no-untyped-def]
        return ["nsenter", f"--net=/proc/{self.pid}/ns/net", *argv]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


class NodeDaemon:
    """`kvsidecar serve` with the given flags, in a node's namespace or in this one, on a socket in workdir."""

    def __init__(self, workdir: Path, args: list[str], node: Node | None = None, name: str = "daemon") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        self.args = ["--socket", self.socket, "--local-buffer-size", "16MiB", "--log-level", "debug", *args]
        self.node = node
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 90.0) -> NodeDaemon:
        argv = [*KVSIDECAR, "serve", *self.args]
        env = dict(os.environ, MC_STORE_CLIENT_SETUP_RETRIES="1")
        with open(self.log_path, "ab") as log:
            kw = {"stdout": log, "stderr": subprocess.STDOUT, "env": env, "start_new_session": True}
            self.proc = self.node.popen(argv, **kw) if self.node else subprocess.Popen(argv, **kw)  # type: ignore[call-overload]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if " ready: grpc " in self.log():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def status(self) -> dict[str, object]:
        """`kvsidecar status --json` over the socket (Unix sockets work across namespaces)."""
        out = subprocess.run(
            [*KVSIDECAR, "status", "--socket", self.socket, "--json"], capture_output=True, text=True, timeout=30
        )
        info: dict[str, object] = json.loads(out.stdout)
        return info

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
