"""The vLLM connector: `kvsidecar_client.vllm.KVSidecarConnector` (imports vLLM; the rest of the client does not).

    --kv-transfer-config '{"kv_connector": "KVSidecarConnector", "kv_connector_module_path": "kvsidecar_client.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "unix:///run/kvsidecar/kvsidecar.sock"}}'

See docs/vllm.md.
"""

from kvsidecar_client.vllm.connector import KVSidecarConnector

__all__ = ["KVSidecarConnector"]
