"""The machine a run measured (CPU, cores, memory, kernel, versions, load) and its processes' CPU and memory."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata
from typing import NamedTuple

__all__ = ["ProcessStats", "describe_machine", "load_average", "process_stats", "wait_rss_settled"]

_PACKAGES = (
    "kvsidecar",
    "kvsidecar-client",
    "kvsidecar-bench",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "torch",
    "grpcio",
    "protobuf",
)


def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _thp(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (other work on a shared machine shows here)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def describe_machine(device: str = "cpu") -> dict[str, object]:
    """Everything the report says about where it ran (with the GPU, for `--device cuda`)."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    try:
        import torch

        torch_threads = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_threads = 0
    extra: dict[str, object] = {}
    if device == "cuda":
        from kvsidecar_bench.device import describe_gpu

        extra["gpu"] = describe_gpu()
    return {
        **extra,
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "usable_cores": usable,
        "memory_gib": round(_memory_bytes() / 2**30, 1),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "transparent_hugepages": _thp(),
        "torch_threads": torch_threads,
        "versions": versions,
        "load_average_at_start": load_average(),
    }


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
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = peak = 0
    with open(f"{proc_dir}/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return ProcessStats(cpu, rss, peak)


def wait_rss_settled(pid: int, target: int, timeout: float = 60.0) -> int:
    """Wait until the process's RSS reaches `target` bytes or stops growing for a second; return the RSS.

    The daemon faults its segment in from a background thread after it is ready: its idle RSS is read after that.
    """
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
