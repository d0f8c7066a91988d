"""Where the daemon listens by default, so `serve`, `status` and every client agree without configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["TICKET_METADATA", "data_socket_path", "default_socket_path", "default_target", "side_socket_path"]

# gRPC metadata key of a side-socket ticket: it stands for the Unix credentials of the process that got it.
TICKET_METADATA = "kvsidecar-ticket"


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """$XDG_RUNTIME_DIR/kvsidecar/kvsidecar.sock, else /tmp/kvsidecar-<uid>/kvsidecar.sock."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvsidecar" if runtime else Path("/tmp") / f"kvsidecar-{os.getuid()}"
    return str(base / "kvsidecar.sock")


def default_target(env: Mapping[str, str] | None = None) -> str:
    """The default socket as a gRPC target (unix:///...)."""
    return f"unix://{default_socket_path(env)}"


def side_socket_path(socket_path: str) -> str:
    """The daemon's side socket (peer credentials, memfd passing) next to its gRPC socket."""
    return socket_path + ".side"


def data_socket_path(socket_path: str) -> str:
    """The daemon's data socket (saves and loads without gRPC: `kvsidecar_contract.frames`) next to its gRPC socket."""
    return socket_path + ".data"
