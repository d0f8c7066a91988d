"""The environment vLLM runs in here: offline, quiet, loopback, with caches of its own (tests and the serving bench).

vLLM reads these at import and at engine start, and its engine processes inherit them: set them first.
"""

from __future__ import annotations

import os
from pathlib import Path


def vllm_environment(cache: Path, *, cpu_kv_cache_gib: int | None) -> dict[str, str]:
    """The variables, caches under `cache`; `cpu_kv_cache_gib` sizes a CPU engine's KV cache (None: on a GPU)."""
    values = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "HF_HOME": str(cache / "hf"),
        "XDG_CACHE_HOME": str(cache / "xdg"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cpu_kv_cache_gib is not None:
        values["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)  # in /dev/shm with the connector
    return values


def set_vllm_environment(cache: Path, *, cpu_kv_cache_gib: int | None) -> None:
    """Set the variables not set already (a caller's own settings win)."""
    for name, value in vllm_environment(cache, cpu_kv_cache_gib=cpu_kv_cache_gib).items():
        os.environ.setdefault(name, value)
