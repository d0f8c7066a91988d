"""The machine and software a run measured: CPU, cores, memory, kernel, versions, and how busy the machine was."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

__all__ = ["describe_machine", "load_average"]

_PACKAGES = (
    "kvsidecar",
    "kvsidecar-client",
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


def describe_machine() -> dict[str, object]:
    """Everything the report says about where it ran."""
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
    return {
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
