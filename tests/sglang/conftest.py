"""SGLang's HiCache backend against a real daemon: fixtures for SGLang's own host pools and backend factory.

Run under .venv-sglang (scripts/setup-sglang.sh). Without SGLang every module here skips itself, so the main suite,
which collects all of tests/, still passes. The daemon is `kvsidecar serve` from the main .venv (not installed
here), started by tests/vllm_connector's starter, as tests/vllm_real does.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "vllm_connector")]

from sidecar_daemon import cache_prefix, daemon  # noqa: E402,F401 (shared fixtures)
