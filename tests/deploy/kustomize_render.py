"""Render a kustomization in Python: the subset deploy/kubernetes uses (no kubectl needed at test time).

Supported: `resources` (files and directories with their own kustomization), `namespace`, `images`
(newName/newTag) and `patches` given by `path` as strategic-merge patches. Anything else raises, so a
kustomization that grows a feature this renderer does not know fails loudly instead of rendering wrongly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

__all__ = ["KNOWN_FIELDS", "UnsupportedKustomization", "render", "resource_key", "split_image"]

KNOWN_FIELDS = frozenset({"apiVersion", "kind", "resources", "namespace", "images", "patches"})

# Merge keys of the lists that strategic merge merges item by item; every other list is replaced whole.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}

# Cluster-scoped kinds this project can contain; the namespace transformer leaves them alone.
_CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "RuntimeClass"})


class UnsupportedKustomization(ValueError):
    """A kustomization uses a field or form this renderer does not implement."""


def resource_key(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    """(apiVersion, kind, namespace, name): how kustomize tells resources apart."""
    meta = doc.get("metadata", {})
    return doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"]


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build directory` would emit, in no particular order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{directory}: fields {sorted(unknown)} are not supported")
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render(path) if path.is_dir() else _load(path))
    keys = [resource_key(d) for d in docs]
    duplicates = {k for k in keys if keys.count(k) > 1}
    if duplicates:
        raise UnsupportedKustomization(f"{directory}: resources defined twice: {sorted(duplicates)}")
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: only `patches: - path: FILE` is supported, not {patch}")
        for patch_doc in _load(directory / patch["path"]):
            if not any(_same_object(doc, patch_doc) for doc in docs):
                raise UnsupportedKustomization(f"{directory}: patch {patch['path']} matches no resource")
            docs = [_merge(doc, patch_doc) if _same_object(doc, patch_doc) else doc for doc in docs]
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in _CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _same_object(doc: dict[str, Any], patch: dict[str, Any]) -> bool:
    return (doc["kind"], doc["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])


def _merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for name, value in patch.items():
            if value is None:
                merged.pop(name, None)
            elif name in merged:
                merged[name] = _merge(merged[name], value, name)
            else:
                merged[name] = copy.deepcopy(value)
        return merged
    merge_key = _MERGE_KEYS.get(key or "")
    if isinstance(base, list) and isinstance(patch, list) and merge_key:
        # kustomize's order: the patch's items first (merged with their originals), then untouched originals.
        originals = {item.get(merge_key): item for item in base}
        patched = [
            _merge(originals[item.get(merge_key)], item) if item.get(merge_key) in originals else copy.deepcopy(item)
            for item in patch
        ]
        named = {item.get(merge_key) for item in patch}
        return patched + [copy.deepcopy(item) for item in base if item.get(merge_key) not in named]
    return copy.deepcopy(patch)


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    if doc["kind"] == "Pod":
        return [spec]
    if doc["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    template = spec.get("template", {}) if isinstance(spec, dict) else {}
    return [template["spec"]] if "spec" in template else []


def _set_image(doc: dict[str, Any], image: dict[str, str]) -> None:
    for pod in _pod_specs(doc):
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            name, tag, digest = split_image(container["image"])
            if name == image["name"]:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def split_image(reference: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a registry's :port is part of the name."""
    reference, _, digest = reference.partition("@")
    colon = reference.rfind(":")
    if colon > reference.rfind("/"):
        return reference[:colon], reference[colon + 1 :], digest
    return reference, "", digest
