"""The vLLM connector: `kvsidecar_client.vllm.KVSidecarConnector` (imports vLLM; the rest of the client does not).

    --kv-transfer-config '{"kv_connector": "KVSidecarConnector", "kv_connector_module_path": "kvsidecar_client.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "unix:///run/kvsidecar/kvsidecar.sock"}}'

See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsidecar_client.vllm.connector import KVSidecarConnector

__all__ = ["KVSidecarConnector"]


def __getattr__(name: str) -> Any:
    # vLLM is imported when vLLM asks for the connector, so the pure modules here (plan) import without it.
    if name == "KVSidecarConnector":
        from kvsidecar_client.vllm.connector import KVSidecarConnector

        return KVSidecarConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
