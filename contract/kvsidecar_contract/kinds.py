"""The group kinds on the wire: the placement core's Kind under the proto enum value of the same name."""

from __future__ import annotations

from kvsidecar_contract.placement.layout import Kind
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["KIND_OF_PROTO", "PROTO_OF_KIND"]

PROTO_OF_KIND: dict[Kind, pb.GroupKind] = {kind: pb.GroupKind.Value(kind.name) for kind in Kind}
KIND_OF_PROTO: dict[pb.GroupKind, Kind] = {value: kind for kind, value in PROTO_OF_KIND.items()}
