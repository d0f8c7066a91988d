"""The backend's settings: SGLang's `--hicache-storage-backend-extra-config`, the one place they are read from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsidecar_client.deadlines import Deadlines
from kvsidecar_client.errors import InvalidRequest
from kvsidecar_contract.paths import default_target

__all__ = ["DEFAULT_STAGING_PAGES", "SGLANG_KEYS", "StorageSettings"]

# Keys SGLang itself reads from the same extra config (the dynamic backend's loader, the v1 interface switch, the
# host pool's allocator); they reach the backend too and are not ours to refuse.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator"})
_KEYS = frozenset(
    {"socket", "cache_prefix", "model_identity", "timeouts", "staging_pages", "zero_copy", "sliding_window"}
)
# Pages one staged call moves (SGLang's storage calls carry at most 128 pages: STORAGE_BATCH_SIZE); a call with more
# moves them in turns. Two such areas (saves, loads) of sealed shared memory per rank.
DEFAULT_STAGING_PAGES = 128


@dataclass(frozen=True)
class StorageSettings:
    """What the extra config may say besides SGLang's own keys.

    socket: the daemon's gRPC target (unix:///path, a bare /path, or host:port).
    cache_prefix: the deployment's namespace in the store; deployments with different prefixes never share a key.
    model_identity: stands for the model's fingerprint (config and weights sample) in the value identity, for
        deployments an operator vouches run the same model (docs/values.md).
    timeouts: per-call deadlines in seconds, any of connect, register, save, lookup, load, control.
    staging_pages: pages of each sealed staging area the pages of a pool not shared in place are copied through.
    zero_copy: move each host pool in place into a sealed memfd the daemon maps (docs/sglang.md); False keeps SGLang's
        memory as it allocated it and copies every page through the staging area.
    sliding_window: tokens of history SGLang restores for a sliding-window pool (its swa_retain_window: the model's
        window, more where a draft model reads further back); 0 takes `sliding_window` from the model's config.json.
    """

    socket: str = field(default_factory=default_target)
    cache_prefix: str = ""
    model_identity: str = ""
    deadlines: Deadlines = field(default_factory=Deadlines)
    staging_pages: int = DEFAULT_STAGING_PAGES
    zero_copy: bool = True
    sliding_window: int = 0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """Parse the extra config; an unknown key or a bad value is an error, never ignored."""
        extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidRequest(
                f"unknown hicache-storage-backend-extra-config keys for KVSidecarStorage: {unknown}; expected "
                f"{sorted(_KEYS)} besides SGLang's own {sorted(SGLANG_KEYS)}"
            )
        socket = extra.get("socket") or default_target()
        prefix = extra.get("cache_prefix", "")
        pinned = extra.get("model_identity", "")
        if not isinstance(socket, str) or not isinstance(prefix, str) or not isinstance(pinned, str):
            raise InvalidRequest("extra config: socket, cache_prefix and model_identity must be strings")
        deadlines = Deadlines.from_config(extra.get("timeouts"), "extra config")
        pages = extra.get("staging_pages", DEFAULT_STAGING_PAGES)
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 1:
            raise InvalidRequest(f"extra config: staging_pages must be an int >= 1, got {pages!r}")
        zero_copy = extra.get("zero_copy", True)
        if not isinstance(zero_copy, bool):
            raise InvalidRequest(f"extra config: zero_copy must be true or false, got {zero_copy!r}")
        window = extra.get("sliding_window", 0)
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise InvalidRequest(f"extra config: sliding_window must be an int >= 0 (tokens), got {window!r}")
        return cls(
            socket=socket,
            cache_prefix=prefix,
            model_identity=pinned,
            deadlines=deadlines,
            staging_pages=pages,
            zero_copy=zero_copy,
            sliding_window=window,
        )
