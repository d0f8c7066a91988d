"""Proto messages to domain values and back; every request field is validated here with a precise reason."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvsidecar.datapath import Failure
from kvsidecar.errors import BadRequest
from kvsidecar.memory import CudaIpcMapping, RegionSpec, ShmMapping
from kvsidecar.session import Role
from kvsidecar_contract.limits import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    MAX_HASHES,
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
)
from kvsidecar_contract.placement import GroupSpec, Kind, Layout, Parallel
from kvsidecar_contract.proto import sidecar_pb2 as pb

_KINDS = {
    pb.FULL_ATTENTION: Kind.FULL_ATTENTION,
    pb.SLIDING_WINDOW: Kind.SLIDING_WINDOW,
    pb.MLA: Kind.MLA,
    pb.SLIDING_WINDOW_MLA: Kind.SLIDING_WINDOW_MLA,
    pb.MAMBA: Kind.MAMBA,
    pb.UNIFORM: Kind.UNIFORM,
}
_ROLES = {pb.ROLE_RANK: Role.RANK, pb.ROLE_SCHEDULER: Role.SCHEDULER}
ROLE_TO_PB = {v: k for k, v in _ROLES.items()}


class Undecodable:
    """A request body that is not a valid message of its type: answered INVALID_ARGUMENT, never UNKNOWN."""

    def __init__(self, message: str, error: str) -> None:
        self.message, self.error = message, error

    def __str__(self) -> str:
        return f"the request is not a valid {self.message}: {self.error}"


def sidecar_handlers(servicer: Any) -> grpc.GenericRpcHandler:
    """The Sidecar service's handlers, parsing requests so that garbage reaches the servicer as Undecodable.

    gRPC's own deserializers raise before any servicer code runs, which clients see as UNKNOWN with no reason.
    """
    service = pb.DESCRIPTOR.services_by_name["Sidecar"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _lenient(cls: Any) -> Any:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc))

    return parse


def open_request(req: pb.OpenSessionRequest) -> tuple[Role, Layout, int]:
    """(role, layout, hash_bytes) of an OpenSession request."""
    if req.role not in _ROLES:
        raise BadRequest("role must be ROLE_RANK or ROLE_SCHEDULER")
    for name, value, most in (
        ("model", req.engine.model, MAX_MODEL_CHARS),
        ("cache_prefix", req.engine.cache_prefix, MAX_NAME_CHARS),
        ("value_identity", req.engine.value_identity, MAX_NAME_CHARS),
        ("client_name", req.client_name, MAX_NAME_CHARS),
    ):
        if len(value) > most:
            raise BadRequest(f"{name} is {len(value)} characters long, more than {most}")
    if not 1 <= req.hash_bytes <= MAX_HASH_BYTES:
        raise BadRequest(f"hash_bytes must be in [1, {MAX_HASH_BYTES}], got {req.hash_bytes}")
    if not req.groups:
        raise BadRequest("a session needs at least one KV-cache group")
    if len(req.groups) > MAX_GROUPS:
        raise BadRequest(f"at most {MAX_GROUPS} KV-cache groups, got {len(req.groups)}")
    groups = tuple(_group(i, g) for i, g in enumerate(req.groups))
    p = req.parallel
    parallel = Parallel(
        tp_size=p.tp_size,
        tp_rank=p.tp_rank,
        pp_size=p.pp_size or 1,
        pp_rank=p.pp_rank,
        pcp_size=p.pcp_size or 1,
        pcp_rank=p.pcp_rank,
        dcp_size=p.dcp_size or 1,
    )
    layout = Layout(
        model=req.engine.model,
        groups=groups,
        parallel=parallel,
        num_kv_heads=req.num_kv_heads,
        hash_block_size=req.hash_block_size,
        cache_prefix=req.engine.cache_prefix,
        value_identity=req.engine.value_identity,
    )
    return _ROLES[req.role], layout, req.hash_bytes


def _group(index: int, g: Any) -> GroupSpec:
    if g.kind not in _KINDS:
        raise BadRequest(f"group {index}: kind must be set")
    inner = []
    for k in g.inner:
        if k not in _KINDS:
            raise BadRequest(f"group {index}: member kinds must be set")
        inner.append(_KINDS[k])
    return GroupSpec(_KINDS[g.kind], g.block_size, g.window, tuple(inner))


def region_specs(regions: Sequence[Any]) -> list[RegionSpec]:
    """Region descriptions of a RegisterMemory request (mapped later, by SessionMemory)."""
    out = []
    for i, r in enumerate(regions):
        which = r.WhichOneof("handle")
        if which == "shm":
            if not r.shm.name:
                raise BadRequest(f"region {i}: shared-memory name is empty")
            key = "shm:" + r.shm.name
            opener: Any = partial(ShmMapping, r.shm.name)
        elif which == "cuda":
            key = f"cuda:{r.cuda.device}:{r.cuda.handle.hex()}:{r.cuda.storage_offset}"
            opener = partial(CudaIpcMapping, r.cuda)
        else:
            raise BadRequest(f"region {i}: needs a shm or cuda handle")
        out.append(
            RegionSpec(
                key, opener, r.mapping_bytes, r.offset, r.block_stride, r.block_bytes, r.num_blocks, tuple(r.groups)
            )
        )
    return out


def hashes(values: Sequence[bytes], hash_bytes: int) -> list[bytes]:
    """Block hashes, each exactly hash_bytes long."""
    if len(values) > MAX_HASHES:
        raise BadRequest(f"at most {MAX_HASHES} block hashes per request, got {len(values)}")
    for i, h in enumerate(values):
        if len(h) != hash_bytes:
            raise BadRequest(f"block hash {i} has {len(h)} bytes, the session declared {hash_bytes}")
    return list(values)


def block_ids(values: Sequence[Any], num_groups: int) -> list[list[int]]:
    """Per-group block ids; their bounds are checked against the regions when used."""
    if len(values) != num_groups:
        raise BadRequest(f"expected block ids for {num_groups} groups, got {len(values)}")
    out = []
    for g, v in enumerate(values):
        if len(v.ids) > MAX_BLOCK_IDS:
            raise BadRequest(f"group {g}: at most {MAX_BLOCK_IDS} block ids, got {len(v.ids)}")
        out.append(list(v.ids))
    return out


def failures(items: Sequence[Failure]) -> list[pb.FailedBlock]:
    """Failed blocks as proto messages."""
    return [pb.FailedBlock(group=f.group, block_id=f.block_id, reason=f.reason) for f in items]
