"""SGLang's HiCache backend against a real daemon: fixtures for SGLang's own host pools and backend factory.

Run under .venv-sglang (scripts/setup-sglang.sh). Without SGLang every module here skips itself, so the main suite,
which collects all of tests/, still passes. The daemon is `kvsidecar serve` from the main .venv (not installed
here), started by tests/vllm_connector's starter, as tests/vllm_real does: one for the run, with a tenants file
that grants this account the cache prefixes the tests use (`t...`) and nothing else, publishing KV events on
loopback (the tenant's topic: `kvsidecar.sglang`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "vllm_connector")]

from sidecar_daemon import SidecarDaemon, cache_prefix  # noqa: E402,F401 (shared fixtures)

from kvsidecar_testing.processes import free_port  # noqa: E402

# The tenant of this account may open sessions under the prefixes cache_prefix makes ("t" + hex), no others.
GRANTED = "t*"


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarDaemon]:
    """One real daemon (embedded real mooncake_master) for the run, multi-tenant; tests keep apart by prefix."""
    workdir = tmp_path_factory.mktemp("kvsidecar")
    tenants = workdir / "tenants.toml"
    tenants.write_text(f'[tenants.sglang]\nuids = [{os.getuid()}]\nprefixes = ["{GRANTED}"]\n')
    events = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    extra = ("--tenants", str(tenants), "--trust-local-accounts", "--kv-events-endpoint", events[0])
    proc = SidecarDaemon(workdir, extra=(*extra, "--kv-events-replay-endpoint", events[1])).start()
    proc.events = events  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SGLang's model path: a directory with a config.json only."""
    from pools import model_dir

    return str(model_dir(tmp_path_factory.mktemp("model")))
