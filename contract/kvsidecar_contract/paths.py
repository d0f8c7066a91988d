"""Where the daemon listens by default, so `serve`, `status` and every client agree without configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["default_socket_path", "default_target"]


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """$XDG_RUNTIME_DIR/kvsidecar/kvsidecar.sock, else /tmp/kvsidecar-<uid>/kvsidecar.sock."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvsidecar" if runtime else Path("/tmp") / f"kvsidecar-{os.getuid()}"
    return str(base / "kvsidecar.sock")


def default_target(env: Mapping[str, str] | None = None) -> str:
    """The default socket as a gRPC target (unix:///...)."""
    return f"unix://{default_socket_path(env)}"
