"""The connector's settings: `kv_connector_extra_config`, the one place they are read from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_client.deadlines import Deadlines
from kvsidecar_client.errors import InvalidRequest
from kvsidecar_client.retention import Retention
from kvsidecar_contract.paths import default_target
from kvsidecar_contract.placement import InvalidLayout, check_share_across_tp

__all__ = ["DEFAULT_WAIT_SLACK", "ConnectorSettings"]

_KEYS = frozenset({"socket", "cache_prefix", "model_identity", "timeouts", "share_across_tp", "retention"})
# How much longer than a save's own deadline the worker waits for it before vLLM may reuse its blocks: past the
# deadline the daemon starts no put and removes what it wrote late, so the blocks are free again.
DEFAULT_WAIT_SLACK = 5.0


@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may say.

    socket: the daemon's gRPC target (unix:///path, a bare /path, or host:port).
    cache_prefix: the deployment's namespace in the store; deployments with different prefixes never share a key.
    model_identity: stands for the model's fingerprint (config and weights sample) in the value identity, for
        deployments an operator vouches run the same model from checkpoints that sample differently (docs/values.md).
    timeouts: per-call deadlines in seconds, any of connect, register, save, lookup, load, control.
    share_across_tp: store attention, MLA and recurrent values for every TP size, so deployments of other TP sizes
        (a TP=4 and a TP=8 fleet, a wide prefill and a narrow decode) read each other's prompts (docs/placement.md
        rules 11, 12): true cuts attention values per KV head and a hybrid's recurrent state per head and B/C group
        (any TP size), an int N as a TP=N engine holds them (fewer, larger values; every TP size that shares must
        divide N). Every deployment that shares sets the same. Recurrent state is described from the model's config
        and checked against vLLM's MambaSpec (vllm/states.py); a model it cannot describe keeps it per layout.
    retention: the retention of requests that ask for none in their kv_transfer_params ({"seconds", "priority",
        "renew", "end_tokens"}: docs/retention.md); none by default.
    """

    socket: str = field(default_factory=default_target)
    cache_prefix: str = ""
    model_identity: str = ""
    deadlines: Deadlines = field(default_factory=Deadlines)
    share_across_tp: bool | int = False
    retention: Retention | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse `kv_connector_extra_config`; an unknown key or a bad value is an error, never ignored."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidRequest(
                f"unknown kv_connector_extra_config keys for KVSidecarConnector: {unknown}; expected {sorted(_KEYS)}"
            )
        socket = extra.get("socket") or default_target()
        prefix = extra.get("cache_prefix", "")
        pinned = extra.get("model_identity", "")
        if not isinstance(socket, str) or not isinstance(prefix, str) or not isinstance(pinned, str):
            raise InvalidRequest("kv_connector_extra_config: socket, cache_prefix and model_identity must be strings")
        deadlines = Deadlines.from_config(extra.get("timeouts"), "kv_connector_extra_config")
        try:
            share = check_share_across_tp(extra.get("share_across_tp", False))
        except InvalidLayout as error:
            raise InvalidRequest(f"kv_connector_extra_config: {error}") from None
        retention = extra.get("retention")
        if retention is not None and not isinstance(retention, Mapping):
            raise InvalidRequest(f"kv_connector_extra_config: retention must be an object, got {retention!r}")
        return cls(
            socket=socket,
            cache_prefix=prefix,
            model_identity=pinned,
            deadlines=deadlines,
            share_across_tp=share,
            retention=None if retention is None else Retention.from_mapping(retention),
        )
