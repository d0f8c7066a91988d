"""The engine's value identity (docs/values.md): what its KV bytes mean beyond the model's name, as one digest.

The scheduler and every worker compute it alike from what vLLM gives them all (the model config, the checkpoint on
disk, the cache config, the KV-cache groups' specs), so their sessions share one key namespace; the daemon folds it
into every key. Anything that changes what a value's bytes mean must change it; nothing that differs between ranks
or nodes of one deployment may (layer names of a PP stage, block counts, paths).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from kvsidecar_client.vllm.regions import REGION_ORDER

__all__ = ["WEIGHT_SUFFIXES", "model_fingerprint", "value_identity", "weights_sample"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 * 1024  # read at the start, the middle and the end of every weight file
# Config fields that name or locate a checkpoint without changing what it computes.
_NAMING_FIELDS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


def weights_sample(path: str) -> str | None:
    """A digest of a local checkpoint's weight files: names, sizes, and their first, middle and last 64 KiB.

    The header of a safetensors file holds every tensor's name, dtype, shape and offset; the sampled data tells a
    fine-tune from its base (same shapes, other numbers) almost surely. None when `path` is not a local directory.
    """
    if not os.path.isdir(path):
        return None
    digest = hashlib.sha256()
    found = False
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(WEIGHT_SUFFIXES):
                continue
            found = True
            full = os.path.join(root, name)
            size = os.path.getsize(full)
            digest.update(f"{os.path.relpath(full, path)}\0{size}\0".encode())
            with open(full, "rb") as file:
                for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                    file.seek(offset)
                    digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest() if found else None


def _config_of(model_config: Any) -> dict[str, Any]:
    # The checkpoint's config.json where there is one: every process reads the same file, while the loaded
    # hf_config of a worker may have been adjusted by model loading after the scheduler took its copy.
    path = os.path.join(str(model_config.model), "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            loaded = json.load(file)
        config = loaded if isinstance(loaded, dict) else {"config": loaded}
    else:
        hf: Any = getattr(model_config, "hf_config", None)
        config = hf.to_dict() if hasattr(hf, "to_dict") else {}
    return {k: v for k, v in config.items() if k not in _NAMING_FIELDS}


def model_fingerprint(model_config: Any) -> dict[str, Any]:
    """What the model computes: its architecture config, dtype, quantization, and its weights or revision."""
    config = _config_of(model_config)
    weights = weights_sample(str(model_config.model))
    return {
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "hf_overrides": repr(getattr(model_config, "hf_overrides", None)),
        "dtype": str(model_config.dtype),
        "quantization": str(getattr(model_config, "quantization", None)),
        # A local checkpoint is sampled; a hub name is only as exact as its pinned revision (docs/values.md).
        "weights": weights or f"revision:{getattr(model_config, 'revision', None) or 'unpinned'}",
    }


# Spec fields that follow the TP size rather than the model: a rank's KV heads and state shapes, and the page
# padding sized to them. The daemon's value id holds T wherever a value's bytes depend on it, and total heads always,
# so leaving these out lets a group shared across TP sizes (docs/placement.md rule 11) have one identity at every T.
_PER_RANK_FIELDS = frozenset({"num_kv_heads", "shapes", "page_size_padded"})


def _describe(spec: Any) -> str:
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return repr(spec)
    kept = [(f.name, repr(getattr(spec, f.name))) for f in dataclasses.fields(spec) if f.name not in _PER_RANK_FIELDS]
    return f"{type(spec).__name__}({', '.join(f'{name}={value}' for name, value in kept)})"


def _spec_descriptions(kv_cache_config: Any) -> list[Any]:
    """Each group's spec with its parameters, without layer names (a PP stage lists only its own layers) and
    without what depends on the rank's share of the model (_PER_RANK_FIELDS)."""
    out: list[Any] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        members = getattr(spec, "kv_cache_specs", None)
        if isinstance(members, dict):
            out.append([type(spec).__name__, sorted({_describe(m) for m in members.values()})])
        else:
            out.append(_describe(spec))
    return out


def value_identity(vllm_config: Any, kv_cache_config: Any, *, pinned: str | None = None) -> str:
    """The digest the connector sends as EngineIdentity.value_identity.

    `pinned` (kv_connector_extra_config "model_identity") stands for the model's fingerprint where an operator
    vouches that deployments run the same model (checkpoints at other paths or in other file layouts); dtypes,
    layout and region order are still the engine's own.
    """
    cache = vllm_config.cache_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cache, "kv_cache_layout", None)
    parts = {
        "model": {"pinned": pinned} if pinned else model_fingerprint(vllm_config.model_config),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "kv_cache_layout": str(layout),
        "specs": _spec_descriptions(kv_cache_config),
        "region_order": REGION_ORDER,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
