"""Which of the daemon's GPUs a rank's memory is on, by the GPU's UUID rather than the rank's index for it.

With per-process CUDA_VISIBLE_DEVICES (Ray, Kubernetes device plugins) every rank sees its GPU as cuda:0; opening
every rank's memory on the daemon's GPU 0 would gather all of them there over peer links, with one staging area.
The rank sends its GPU's UUID (torch's device properties); the daemon finds it among the GPUs it sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.errors import BadRequest

__all__ = ["normalized_uuid", "ordinal_of"]


def normalized_uuid(uuid: str) -> str:
    """A GPU UUID as torch and nvidia-smi both spell it: lower case, without nvidia-smi's "GPU-" prefix."""
    text = uuid.strip().lower()
    return text.removeprefix("gpu-")


def ordinal_of(uuid: str, index: int, seen: Sequence[str]) -> int:
    """The daemon's index of the GPU with this UUID, among the UUIDs it sees (in its own order).

    An empty UUID (a client older than the field) names the rank's own index, which only a daemon seeing one GPU can
    read unambiguously; any other GPU the daemon does not see is refused with the reason."""
    if not uuid:
        if len(seen) == 1:
            return 0
        raise BadRequest(
            f"CUDA memory on the rank's cuda:{index}, without the GPU's UUID: this daemon sees {len(seen)} GPUs and "
            "cannot tell which (per-process CUDA_VISIBLE_DEVICES numbers them differently); update kvsidecar_client"
        )
    wanted = normalized_uuid(uuid)
    for ordinal, candidate in enumerate(seen):
        if normalized_uuid(candidate) == wanted:
            return ordinal
    listed = ", ".join(f"cuda:{i} {normalized_uuid(u)}" for i, u in enumerate(seen)) or "none"
    raise BadRequest(
        f"CUDA memory on GPU {wanted} (the rank's cuda:{index}), which this daemon does not see (it sees: {listed}): "
        "give the daemon every GPU its node's ranks use (its CUDA_VISIBLE_DEVICES)"
    )
