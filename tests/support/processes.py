"""Real processes for integration tests: free loopback ports, a daemon started and stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_pid(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after timeout; reap; return the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class DaemonProcess:
    """`kvsidecar serve` in its own process, on a socket in a temp dir and a free metrics port."""

    def __init__(
        self, workdir: Path, *, master: str = "", extra: tuple[str, ...] = (), env: dict[str, str] | None = None
    ):
        self.workdir = workdir
        self.socket = str(workdir / "kvsidecar.sock")
        self.metrics_port = free_port()
        self.master = master
        self.extra = extra
        self.env = env
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """The gRPC target of the daemon's socket."""
        return f"unix://{self.socket}"

    @property
    def metrics_url(self) -> str:
        """Where Prometheus would scrape."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        """Start the daemon and wait until its health service answers SERVING."""
        args = [
            sys.executable, "-m", "kvsidecar", "serve",
            "--socket", self.socket,
            "--metrics-address", f"127.0.0.1:{self.metrics_port}",
            "--segment-size", "64MiB",
            "--local-buffer-size", "16MiB",
            "--session-ttl", "3",
            "--log-level", "debug",
        ]  # fmt: skip
        if self.master:
            args += ["--master", self.master]
        args += list(self.extra)
        env = dict(os.environ, **(self.env or {}))
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.serving():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daemon not serving after {timeout}s:\n{self.log()}")

    def serving(self) -> bool:
        """Whether the health service answers SERVING."""
        if not os.path.exists(self.socket):
            return False
        try:
            with grpc.insecure_channel(self.target) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self, timeout: float = 20.0) -> int:
        """Stop by PID (SIGTERM, then SIGKILL) and return the exit code."""
        assert self.proc is not None
        return stop_pid(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def log(self) -> str:
        """Everything the daemon printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
