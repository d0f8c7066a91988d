"""`--device cuda`: what it needs (checked before anything starts) and the GPU the report names."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from importlib import metadata

from kvsidecar_bench.errors import BenchError

__all__ = ["check_device", "cuda_problems", "describe_gpu", "mooncake_builds"]

MOONCAKE_CUDA = "mooncake-transfer-engine"
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda"


def mooncake_builds() -> dict[str, str]:
    """Installed Mooncake distributions and their versions (read from metadata: only mooncake_direct imports it)."""
    out = {}
    for name in (MOONCAKE_CUDA, MOONCAKE_CPU):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cuda_problems(torch_version: str, torch_cuda: str | None, devices: int, mooncake: Mapping[str, str]) -> list[str]:
    """Why `--device cuda` cannot run here, one reason each (none: it can)."""
    problems = []
    if torch_cuda is None:
        problems.append(f"torch {torch_version} is a CPU-only build (torch.version.cuda is None): install a CUDA torch")
    elif devices < 1:
        problems.append(f"torch {torch_version} (CUDA {torch_cuda}) sees no CUDA device (device_count() == 0)")
    if MOONCAKE_CUDA not in mooncake:
        found = f"{MOONCAKE_CPU} {mooncake[MOONCAKE_CPU]} is installed" if MOONCAKE_CPU in mooncake else "none is"
        problems.append(
            f"Mooncake's CUDA build ({MOONCAKE_CUDA}) is needed to move GPU memory, {found}: "
            "run scripts/setup.sh with FLAVOUR=cuda in a fresh venv"
        )
    elif MOONCAKE_CPU in mooncake:
        problems.append(f"both {MOONCAKE_CUDA} and {MOONCAKE_CPU} are installed (one `mooncake` module): keep one")
    return problems


def check_device(device: str) -> None:
    """Raise BenchError with every reason `device` cannot be benchmarked here (before any process starts)."""
    if device == "cpu":
        return
    import torch

    devices = torch.cuda.device_count() if torch.version.cuda is not None else 0
    problems = cuda_problems(torch.__version__, torch.version.cuda, devices, mooncake_builds())
    if problems:
        raise BenchError("--device cuda cannot run here: " + "; ".join(problems))


def describe_gpu() -> dict[str, object]:
    """cuda:0's name and memory, torch's CUDA version and the driver's (nvidia-smi; torch has no public call)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    driver = "unknown"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            run = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            driver = run.stdout.strip() or driver
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "driver": driver,
        "count": torch.cuda.device_count(),
    }
