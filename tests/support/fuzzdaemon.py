"""A real daemon process for fuzzing: a memory ceiling, a long lease, and checks that it is alive and answering."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import grpc

from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.proto import sidecar_pb2_grpc as pb_grpc
from kvsidecar_testing.processes import DaemonProcess

GiB = 1 << 30


class FuzzDaemon(DaemonProcess):
    """`kvsidecar serve` against a real master, with room to spare in the store and a lease that outlives shrinking.

    After start the process gets an address-space ceiling (its size then plus `headroom`): a request that makes the
    daemon allocate without bound fails it (MemoryError, a crash) instead of taking the shared machine down with it.
    """

    def __init__(
        self, workdir: Path, *, master: str, session_ttl: float = 120.0, headroom: int = 4 * GiB, extra=()
    ) -> None:
        # The fuzzers' ranks register guarded named /dev/shm segments: the trusted ranks' right, granted here.
        super().__init__(
            workdir,
            master=master,
            session_ttl=session_ttl,
            segment_size="256MiB",
            log_level="info",
            extra=extra,
            allow_shm_names=True,
        )
        self.headroom = headroom
        self._channel: grpc.Channel | None = None

    def start(self, timeout: float = 60.0) -> FuzzDaemon:
        super().start(timeout)
        assert self.proc is not None
        size = _vm_size(self.proc.pid)
        limit = size + self.headroom
        resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (limit, limit))
        self._channel = grpc.insecure_channel(self.target)
        return self

    def check(self, timeout: float = 10.0) -> None:
        """Raise AssertionError unless the process lives and answers Stats."""
        if not self.alive():
            assert self.proc is not None
            raise AssertionError(f"daemon died with exit code {self.proc.returncode}:\n{self.log()[-4000:]}")
        assert self._channel is not None
        try:
            pb_grpc.SidecarStub(self._channel).Stats(pb.StatsRequest(), timeout=timeout)
        except grpc.RpcError as error:
            raise AssertionError(f"daemon alive but not answering Stats: {error.code()} {error.details()}") from None

    def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        """The daemon's Stats answer."""
        assert self._channel is not None
        response: pb.StatsResponse = pb_grpc.SidecarStub(self._channel).Stats(pb.StatsRequest(), timeout=timeout)
        return response

    def mapped_shm(self) -> set[str]:
        """Names of the /dev/shm segments the daemon has mapped right now."""
        names = set()
        with open(f"/proc/{self.pid}/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/dev/shm/"):
                    names.add(path[len("/dev/shm/") :].removesuffix(" (deleted)"))
        return names

    def rss_bytes(self) -> int:
        """Resident memory of the daemon."""
        return _status_kib(self.pid, "VmRSS") * 1024

    def stop(self, timeout: float = 20.0) -> int | None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        return super().stop(timeout)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(f"{field} not in /proc/{pid}/status")


def _vm_size(pid: int) -> int:
    return _status_kib(pid, "VmSize") * 1024


def shm_exists(name: str) -> bool:
    """Whether /dev/shm/<name> is still there."""
    return os.path.exists(os.path.join("/dev/shm", name))
