"""The processes a bench run starts and stops by PID: the daemon, Mooncake's real client, and their CPU and RSS."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvsidecar.master import LOOPBACK, free_ports

__all__ = [
    "MOONCAKE_ENV",
    "BenchError",
    "DaemonProcess",
    "ProcessStats",
    "RealClientProcess",
    "native_output_to",
    "process_stats",
    "stop_process",
    "wait_rss_settled",
]

# Mooncake's own environment, set at this edge for every client the run creates (and inherited by its children).
MOONCAKE_ENV = {
    "MC_TCP_BIND_ADDRESS": LOOPBACK,
    "MC_LOG_LEVEL": "ERROR",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
}
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_STOP_TIMEOUT_S = 20.0


class BenchError(RuntimeError):
    """The bench cannot go on (a process did not start, a path moved the wrong bytes)."""


class ProcessStats(NamedTuple):
    """CPU seconds (user + system, all threads) and memory of one process."""

    cpu_s: float
    rss_bytes: int
    peak_rss_bytes: int


def process_stats(pid: int, proc_dir: str = "/proc") -> ProcessStats:
    """Read /proc/<pid>/stat and status."""
    with open(f"{proc_dir}/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    rss = peak = 0
    with open(f"{proc_dir}/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return ProcessStats(cpu, rss, peak)


def wait_rss_settled(pid: int, target: int, timeout: float = 60.0) -> int:
    """Wait until the process's RSS reaches `target` bytes or stops growing for a second; return the RSS."""
    deadline = time.monotonic() + timeout
    last = process_stats(pid).rss_bytes
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        rss = process_stats(pid).rss_bytes
        if rss >= target:
            return rss
        if rss > last + (1 << 20):
            last, still_since = rss, time.monotonic()
        elif time.monotonic() - still_since > 1.0:
            return rss
    return last


def stop_process(proc: subprocess.Popen[Any], timeout: float = _STOP_TIMEOUT_S) -> int:
    """SIGTERM, then SIGKILL after `timeout`; reap; return the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@contextlib.contextmanager
def native_output_to(path: Path) -> Iterator[None]:
    """Send what native code writes to fd 2 (Mooncake's glog lines) to a file while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    from kvsidecar.store.native import ensure_native_libs

    return {**os.environ, **MOONCAKE_ENV, **ensure_native_libs(), **extra}


class DaemonProcess:
    """`python -m kvsidecar serve` against a given master, on a socket in the run's folder."""

    def __init__(self, workdir: Path, master: str, segment_size: int) -> None:
        self.socket = str(workdir / "kvsidecar.sock")
        self.log_path = workdir / "daemon.log"
        self.master = master
        self.segment_size = segment_size
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """The gRPC target clients connect to."""
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int:
        """The daemon's PID."""
        if self.proc is None:
            raise BenchError("the daemon is not running")
        return self.proc.pid

    def command(self) -> list[str]:
        """The exact command line the bench runs."""
        return [
            sys.executable, "-m", "kvsidecar", "serve",
            "--master", self.master,
            "--socket", self.socket,
            "--metrics-address", f"{LOOPBACK}:0",
            "--segment-size", str(self.segment_size),
            "--log-level", "warning",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        """Start it and wait until its health service answers SERVING."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_child_env({})
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._serving():
                return self
            time.sleep(0.1)
        raise BenchError(f"the daemon is not serving after {timeout:.0f} s:\n{self.log_tail()}")

    def _serving(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if not os.path.exists(self.socket):
            return False
        try:
            with grpc.insecure_channel(self.target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def stats(self) -> ProcessStats:
        """CPU and memory of the daemon so far."""
        return process_stats(self.pid)

    def log_tail(self, lines: int = 30) -> str:
        """The end of what the daemon printed."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        """Stop by PID."""
        proc, self.proc = self.proc, None
        return None if proc is None else stop_process(proc)


class RealClientProcess:
    """Mooncake's `mooncake_client` (the "real client" that owns a segment and serves dummy clients)."""

    def __init__(self, workdir: Path, master: str, segment_size: int) -> None:
        self.log_path = workdir / "mooncake_client.log"
        self.master = master
        self.segment_size = segment_size
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> Path | None:
        """mooncake_client next to the interpreter, if the wheel ships it."""
        path = Path(sys.executable).parent / "mooncake_client"
        return path if path.is_file() and os.access(path, os.X_OK) else None

    @property
    def address(self) -> str:
        """host:port a dummy client connects to."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        """Its PID (the console script execs the server itself)."""
        if self.proc is None:
            raise BenchError("mooncake_client is not running")
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> RealClientProcess:
        """Start it on a free port and wait until the port accepts connections."""
        binary = self.binary()
        if binary is None:
            raise BenchError("this Mooncake wheel has no mooncake_client")
        (self.port,) = free_ports(1)
        command = [
            str(binary),
            f"--master_server_address={self.master}",
            "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={self.segment_size // (1 << 20)}MB",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            "--protocol=tcp",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_child_env({})
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"mooncake_client exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), timeout=0.5):
                return self
            time.sleep(0.1)
        raise BenchError(f"mooncake_client did not listen on {self.address} within {timeout:.0f} s")

    def stats(self) -> ProcessStats:
        """CPU and memory so far."""
        return process_stats(self.pid)

    def stop(self) -> int | None:
        """Stop by PID."""
        proc, self.proc = self.proc, None
        return None if proc is None else stop_process(proc)
