"""Real processes, started on free loopback ports and private folders and stopped by PID: the daemon, a storage node.

Readiness is an event, not a guess: the daemon tells its NOTIFY_SOCKET READY=1 once it serves (kvsidecar.daemon.notify),
and a storage node listens on its port only after it has mounted its segment. Waits take a clock and a backoff.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvsidecar_testing.mooncake_env import MooncakeEnv
from kvsidecar_testing.waiting import DEFAULT_BACKOFF, SYSTEM_CLOCK, Backoff, Clock, wait_until

__all__ = ["LOOPBACK", "DaemonProcess", "ProcessError", "StorageNode", "free_port", "stop_pid"]

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class ProcessError(RuntimeError):
    """A process did not start, or exited while it was expected to run; carries the end of its log."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def stop_pid(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, then SIGKILL after timeout; reap; return the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class DaemonProcess:
    """`kvsidecar serve` in its own process, on a socket in `workdir` and a free metrics port; stopped by PID.

    `python` is the interpreter that has the daemon installed (the vLLM suite's venv has only the client, so it
    passes the main venv's). Without `master` the daemon starts its embedded one.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        master: str = "",
        # Long enough that a raw rank idle between two calls on a busy machine keeps its session; a test about
        # expiry asks for a short lease itself.
        session_ttl: float | None = 30,
        segment_size: str = "64MiB",
        local_buffer_size: str | None = "16MiB",
        log_level: str = "debug",
        extra: Sequence[str] = (),
        allow_shm_names: bool = False,
        env: Mapping[str, str] | None = None,
        python: str | os.PathLike[str] = sys.executable,
        mooncake: MooncakeEnv | None = None,
        clock: Clock = SYSTEM_CLOCK,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.workdir = Path(workdir)
        self.socket = str(self.workdir / "kvsidecar.sock")
        self.metrics_port = free_port()
        self.master = master
        self.session_ttl = session_ttl
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        self.log_level = log_level
        self.extra = tuple(extra)
        # Raw test ranks register named /dev/shm segments: a right granted only explicitly, as to trusted ranks.
        self.allow_shm_names = allow_shm_names
        self.env = dict(env or {})
        self.python = str(python)
        self.clock, self.backoff = clock, backoff
        self._own_mooncake = mooncake is None
        self.mooncake = mooncake
        self.log_path = self.workdir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """The gRPC target of the daemon's socket."""
        return f"unix://{self.socket}"

    @property
    def metrics_url(self) -> str:
        """Where Prometheus would scrape."""
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    def requests_by_method(self) -> dict[str, float]:
        """Requests the daemon received, by method (kvsidecar_requests_total), from its metrics endpoint."""
        return self.metric_samples("kvsidecar_requests_total", "method")

    def metric_samples(self, name: str, label: str = "") -> dict[str, float]:
        """One metric's samples from the metrics endpoint, by the value of `label` ("" for an unlabelled one)."""
        with urllib.request.urlopen(self.metrics_url, timeout=30) as reply:
            body = reply.read().decode()
        labels = rf'\{{[^}}]*{re.escape(label)}="(?P<value_of>[^"]*)"[^}}]*\}}' if label else ""
        sample = re.compile(rf"^{re.escape(name)}{labels} (?P<value>\S+)$", re.M)
        return {(m["value_of"] if label else ""): float(m["value"]) for m in sample.finditer(body)}

    @property
    def pid(self) -> int:
        """The daemon's PID."""
        if self.proc is None:
            raise ProcessError("the daemon has not been started")
        return self.proc.pid

    def alive(self) -> bool:
        """The process runs."""
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """The exact command line."""
        args = [
            self.python, "-m", "kvsidecar", "serve",
            "--socket", self.socket,
            "--metrics-address", f"{LOOPBACK}:{self.metrics_port}",
            "--segment-size", self.segment_size,
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.local_buffer_size is not None:
            args += ["--local-buffer-size", self.local_buffer_size]
        if self.session_ttl is not None:
            args += ["--session-ttl", f"{self.session_ttl:g}"]
        if self.master:
            args += ["--master", self.master]
        if self.allow_shm_names:
            args += ["--allow-shm-names"]
        return args + list(self.extra)

    def start(self, timeout: float = START_TIMEOUT_S) -> DaemonProcess:
        """Start the daemon and wait until it says it is ready (or, with a NOTIFY_SOCKET of the caller's, serves)."""
        if self.mooncake is None:
            self.mooncake = MooncakeEnv(self.workdir)
        notify: socket.socket | None = None
        env = self.mooncake.child_env(self.env, native=False)
        if "NOTIFY_SOCKET" not in self.env:
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            path = self.workdir / "notify.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            notify.bind(str(path))
            env["NOTIFY_SOCKET"] = str(path)
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,
                )  # fmt: skip
            listener = notify

            def ready() -> bool:
                self._check_running()
                return self._told_ready(listener) if listener is not None else self.serving()

            try:
                wait_until(
                    ready,
                    timeout=timeout, what="daemon ready", clock=self.clock, backoff=self.backoff, detail=self.log,
                )  # fmt: skip
            except BaseException:
                self.stop()
                raise
        finally:
            if notify is not None:
                notify.close()
        return self

    def _check_running(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ProcessError(f"the daemon exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
        return True

    @staticmethod
    def _told_ready(notify: socket.socket) -> bool:
        readable, _, _ = select.select([notify], [], [], 0)
        while readable:
            if b"READY=1" in notify.recv(4096).split(b"\n"):
                return True
            readable, _, _ = select.select([notify], [], [], 0)
        return False

    def serving(self) -> bool:
        """Whether the health service answers SERVING."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if not os.path.exists(self.socket):
            return False
        try:
            with grpc.insecure_channel(self.target) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Stop by PID (SIGTERM, then SIGKILL) and return the exit code; remove its private Mooncake folder."""
        code = None if self.proc is None else stop_pid(self.proc, timeout)
        if self._own_mooncake and self.mooncake is not None:
            self.mooncake.close()
            self.mooncake = None
        return code

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def log(self) -> str:
        """Everything the daemon printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class StorageNode:
    """Mooncake's `mooncake_client` (its "real client"): a segment on a master that outlives any daemon."""

    def __init__(
        self,
        master: str,
        workdir: Path,
        *,
        segment: str = "128MB",
        local_buffer: str | None = "16MB",
        mooncake: MooncakeEnv | None = None,
        clock: Clock = SYSTEM_CLOCK,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.master = master
        self.port = 0
        self.segment, self.local_buffer = segment, local_buffer
        self.workdir = Path(workdir)
        self.log_path = self.workdir / "mooncake_client.log"
        self.clock, self.backoff = clock, backoff
        self._own_mooncake = mooncake is None
        self.mooncake = mooncake
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
            raise ProcessError("mooncake_client is not running")
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> StorageNode:
        """Start on a free port; ready once the port accepts connections (it mounts its segment before listening)."""
        binary = self.binary()
        if binary is None:
            raise ProcessError("this Mooncake wheel has no mooncake_client")
        if self.mooncake is None:
            self.mooncake = MooncakeEnv(self.workdir)
        self.port = free_port()
        command = [
            str(binary), f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={self.segment}", f"--host={LOOPBACK}", f"--port={self.port}", "--protocol=tcp",
        ]  # fmt: skip
        if self.local_buffer is not None:
            command.append(f"--local_buffer_size={self.local_buffer}")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.mooncake.child_env(), start_new_session=True,
            )  # fmt: skip
        try:
            wait_until(self._listening, timeout=timeout, what="mooncake_client listening", clock=self.clock,
                       backoff=self.backoff)  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ProcessError(f"mooncake_client exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> int | None:
        """Stop by PID."""
        proc, self.proc = self.proc, None
        code = None if proc is None else stop_pid(proc)
        if self._own_mooncake and self.mooncake is not None:
            self.mooncake.close()
            self.mooncake = None
        return code
