"""SGLang's HiCache storage backend `kvsidecar_client.sglang.KVSidecarStorage` (imports SGLang; nothing else does).

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvsidecar", "module_path": "kvsidecar_client.sglang", "class_name": "KVSidecarStorage",
        "interface_v1": 1, "socket": "unix:///run/kvsidecar/kvsidecar.sock"}'

See docs/sglang.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsidecar_client.sglang.storage import KVSidecarStorage

__all__ = ["KVSidecarStorage"]


def __getattr__(name: str) -> Any:
    # SGLang is imported when SGLang asks for the backend, so the pure modules here (pages, settings) import without it.
    if name == "KVSidecarStorage":
        from kvsidecar_client.sglang.storage import KVSidecarStorage

        return KVSidecarStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
