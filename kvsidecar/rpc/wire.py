"""Proto messages to domain values and domain results back to proto; request fields are checked with a precise reason.

Nothing else: no memory is opened, no session looked up, no store called here.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvsidecar import __version__
from kvsidecar.errors import BadRequest
from kvsidecar.fence.guard import Listener
from kvsidecar.rpc.retention import retention_args
from kvsidecar.store import StoreHealth
from kvsidecar.values import (
    CudaHandle,
    Failure,
    Handle,
    LoadArgs,
    LoadOutcome,
    LookupArgs,
    MemfdHandle,
    RegionRequest,
    Role,
    SaveArgs,
    SaveOutcome,
    SessionSummary,
    ShmHandle,
)
from kvsidecar_contract.limits import (
    MAX_BATCH_ITEMS,
    MAX_BLOCK_IDS,
    MAX_HASH_BYTES,
    MAX_HASHES,
    MAX_NAME_CHARS,
)
from kvsidecar_contract.mapping import from_message, hit_to_message, parallel_to_message
from kvsidecar_contract.methods import BY_NAME, METHODS, Method
from kvsidecar_contract.placement import Geometry, Hit, Layout, PackedHashes
from kvsidecar_contract.proto import sidecar_pb2 as pb

_ROLES = {pb.ROLE_RANK: Role.RANK, pb.ROLE_SCHEDULER: Role.SCHEDULER}
ROLE_TO_PB = {v: k for k, v in _ROLES.items()}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Sidecar"].full_name


class Undecodable:
    """A request body that is not a valid message of its type: answered INVALID_ARGUMENT, never UNKNOWN."""

    def __init__(self, message: str, error: str) -> None:
        self.message, self.error = message, error

    def __str__(self) -> str:
        return f"the request is not a valid {self.message}: {self.error}"


class Oversized(Undecodable):
    """A request body larger than its method's limit: refused before it is parsed (parsing runs on the event loop)."""

    def __init__(self, message: str, size: int, most: int, why: str) -> None:
        super().__init__(message, "")
        self.size, self.most, self.why = size, most, why

    def __str__(self) -> str:
        return f"a {self.message} of {self.size} bytes: at most {self.most} per call ({self.why})"


# A hash in a LookupRequest costs its bytes, a tag byte and a length byte (MAX_HASH_BYTES < 128); the other fields
# (session id, token count, flags) fit in the slack many times over.
_HASH_FIELD_OVERHEAD = 2
_REQUEST_SLACK_BYTES = 64 << 10


def lookup_request_bytes(max_hashes: int) -> int:
    """The largest LookupRequest of at most max_hashes hashes (each at most MAX_HASH_BYTES long), with slack."""
    return max_hashes * (MAX_HASH_BYTES + _HASH_FIELD_OVERHEAD) + _REQUEST_SLACK_BYTES


def lookup_limit(max_hashes: int) -> tuple[int, str]:
    """(most bytes, why) of a LookupRequest under --max-lookup-hashes, for `lenient`: refused before it is parsed."""
    why = f"--max-lookup-hashes {max_hashes} hashes of at most {MAX_HASH_BYTES} bytes"
    return lookup_request_bytes(max_hashes), why


def request_parser(method: Method, max_lookup_hashes: int) -> Callable[[bytes | bytearray], Any]:
    """The parser of a method's requests, the same for gRPC and the data socket: garbage comes back Undecodable,
    a request past its row's size limit Oversized (unparsed).

    Built once per method (a parser per call costs every save and load); a Lookup's once per --max-lookup-hashes.
    """
    if method.limit == "max-lookup-hashes":
        return _bounded_parser(method.name, max_lookup_hashes)
    return _PARSERS[method.name]


@functools.lru_cache(maxsize=8)
def _bounded_parser(name: str, max_lookup_hashes: int) -> Callable[[bytes | bytearray], Any]:
    return lenient(BY_NAME[name].request, *lookup_limit(max_lookup_hashes))


def lenient(cls: Any, most: int = 0, why: str = "") -> Callable[[bytes | bytearray], Any]:
    """A parser of cls's messages answering Undecodable for garbage and Oversized past `most` bytes."""

    def parse(data: bytes | bytearray) -> Any:
        if most and len(data) > most:
            return Oversized(cls.DESCRIPTOR.name, len(data), most, why)
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc))

    return parse


_PARSERS: dict[str, Callable[[bytes | bytearray], Any]] = {method.name: lenient(method.request) for method in METHODS}


def open_request(req: pb.OpenSessionRequest) -> tuple[Role, Layout, int]:
    """(role, layout, hash_bytes) of an OpenSession request; the layout is the contract's reading of the message."""
    if req.role not in _ROLES:
        raise BadRequest("role must be ROLE_RANK or ROLE_SCHEDULER")
    if len(req.client_name) > MAX_NAME_CHARS:
        raise BadRequest(f"client_name is {len(req.client_name)} characters long, more than {MAX_NAME_CHARS}")
    if not 1 <= req.hash_bytes <= MAX_HASH_BYTES:
        raise BadRequest(f"hash_bytes must be in [1, {MAX_HASH_BYTES}], got {req.hash_bytes}")
    return _ROLES[req.role], from_message(req), req.hash_bytes


def regions(items: Sequence[Any]) -> list[RegionRequest]:
    """Regions of a RegisterMemory request (their handles are checked and opened by memory/ at registration)."""
    out = []
    for r in items:
        which = r.WhichOneof("handle")
        handle: Handle | None = None
        if which == "shm":
            handle = ShmHandle(r.shm.name)
        elif which == "memfd":
            handle = MemfdHandle(r.memfd.index)
        elif which == "cuda":
            c = r.cuda
            handle = CudaHandle(
                device=c.device,
                handle=c.handle,
                storage_size=c.storage_size,
                storage_offset=c.storage_offset,
                ref_counter_handle=c.ref_counter_handle,
                ref_counter_offset=c.ref_counter_offset,
                event_handle=c.event_handle,
                event_sync_required=c.event_sync_required,
                device_uuid=c.device_uuid,
            )
        out.append(
            RegionRequest(
                handle,
                r.mapping_bytes,
                r.offset,
                r.block_stride,
                r.block_bytes,
                r.num_blocks,
                tuple(r.groups),
                r.heads,
            )
        )
    return out


def hashes(values: Sequence[bytes], hash_bytes: int) -> list[bytes]:
    """Block hashes, each exactly hash_bytes long."""
    if len(values) > MAX_HASHES:
        raise BadRequest(f"at most {MAX_HASHES} block hashes per request, got {len(values)}")
    # One copy and one C-level pass for the common case (a 128k-token lookup sends 8192 hashes): 0.8 -> 0.3 ms.
    out = list(values)
    if out and set(map(len, out)) != {hash_bytes}:
        for i, h in enumerate(out):
            if len(h) != hash_bytes:
                raise BadRequest(f"block hash {i} has {len(h)} bytes, the session declared {hash_bytes}")
    return out


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


def batch_items(items: Sequence[Any], method: str) -> list[Any]:
    """A SaveBatch or LoadBatch's items (each a name and a request), checked: unique names, and the batch as a whole
    within the per-request limits."""
    if len(items) > MAX_BATCH_ITEMS:
        raise BadRequest(f"{method}: at most {MAX_BATCH_ITEMS} items per batch, got {len(items)}")
    names = Counter(item.name for item in items)
    if len(names) != len(items):
        dup = next(name for name, n in names.items() if n > 1)
        raise BadRequest(f"{method}: item names must be unique, {dup[:MAX_NAME_CHARS]!r} appears more than once")
    # One request this size would be refused: a batch is no way around the limits.
    total_hashes = sum(len(item.request.block_hashes) for item in items)
    if total_hashes > MAX_HASHES:
        raise BadRequest(
            f"{method}: at most {MAX_HASHES} block hashes per batch, all items together, got {total_hashes}"
        )
    total_ids = sum(len(g.ids) for item in items for g in item.request.block_ids)
    if total_ids > MAX_BLOCK_IDS:
        raise BadRequest(f"{method}: at most {MAX_BLOCK_IDS} block ids per batch (all items), got {total_ids}")
    return list(items)


def save_args(req: pb.SaveRequest, hash_bytes: int, num_groups: int) -> SaveArgs:
    """One Save request's (or SaveBatch item's) values."""
    if req.token_ids and req.token_ids_start + len(req.token_ids) > req.num_tokens:
        raise BadRequest(
            f"token_ids: {len(req.token_ids)} tokens from position {req.token_ids_start} run past num_tokens "
            f"{req.num_tokens}"
        )
    return SaveArgs(
        hashes(req.block_hashes, hash_bytes),
        block_ids(req.block_ids, num_groups),
        req.num_tokens,
        req.saved_tokens,
        req.token_ids,
        req.token_ids_start,
        retention_args(req),
    )


def lookup_args(req: pb.LookupRequest, hash_bytes: int) -> LookupArgs:
    """One Lookup request's values: its hashes as sent, a list or packed (only those probed become objects)."""
    if req.packed_block_hashes:
        if req.block_hashes:
            raise BadRequest("block_hashes and packed_block_hashes are both set: send the hashes one way")
        return LookupArgs(packed_hashes(req.packed_block_hashes, hash_bytes), req.num_tokens, req.eagle)
    return LookupArgs(hashes(req.block_hashes, hash_bytes), req.num_tokens, req.eagle)


def packed_hashes(data: bytes, hash_bytes: int) -> PackedHashes:
    """Block hashes sent back to back: a whole number of the session's hash_bytes, at most MAX_HASHES of them."""
    if len(data) % hash_bytes:
        raise BadRequest(
            f"packed_block_hashes holds {len(data)} bytes, not a whole number of {hash_bytes}-byte hashes "
            "(the session's hash_bytes)"
        )
    if len(data) // hash_bytes > MAX_HASHES:
        raise BadRequest(f"at most {MAX_HASHES} block hashes per request, got {len(data) // hash_bytes}")
    return PackedHashes(data, hash_bytes)


def load_args(req: pb.LoadRequest, hash_bytes: int, num_groups: int) -> LoadArgs:
    """One Load request's (or LoadBatch item's) values."""
    if len(req.carried_groups) > num_groups:
        raise BadRequest(f"carried_groups names {len(req.carried_groups)} groups, the session has {num_groups}")
    return LoadArgs(
        hashes(req.block_hashes, hash_bytes),
        block_ids(req.block_ids, num_groups),
        req.hit_tokens,
        list(req.tail_boundaries),
        req.start_tokens,
        retention_args(req),
        list(req.carried_groups),
    )


def item_error(code: grpc.StatusCode, reason: str) -> pb.ItemError:
    """A batch item's refusal: the status a lone request would have got."""
    return pb.ItemError(code=code.value[0], reason=reason)


def failures(items: Sequence[Failure]) -> list[pb.FailedBlock]:
    """Failed blocks as proto messages."""
    return [pb.FailedBlock(group=f.group, block_id=f.block_id, reason=f.reason.value) for f in items]


def open_response(
    session_id: str, lease_s: float, geo: Geometry, side_secret: bytes = b"", tenant: str = ""
) -> pb.OpenSessionResponse:
    """A new session's id, lease and placement, as the engine needs them."""
    return pb.OpenSessionResponse(
        session_id=session_id,
        lease_ms=int(lease_s * 1000),
        hit_alignment_tokens=geo.unit,
        fine_grained_hits=geo.fine_grained,
        groups=[
            pb.GroupPlacement(
                replication_factor=g.factor,
                shard_id=g.shard,
                keys_per_boundary=g.keys_per_boundary,
                span_tokens=g.span,
                shared_across_tp=g.shared,
                values_per_block=len(g.own),
            )
            for g in geo.groups
        ],
        daemon_version=__version__,
        side_secret=side_secret,
        tenant=tenant,
        packed_hashes=True,
    )


def register_response(mapped_bytes: int, value_bytes: Sequence[int]) -> pb.RegisterMemoryResponse:
    """What a registration mapped."""
    return pb.RegisterMemoryResponse(mapped_bytes=mapped_bytes, value_bytes=value_bytes)


def keepalive_response(lease_s: float, store_healthy: bool) -> pb.KeepAliveResponse:
    """A renewed lease and the store's health."""
    return pb.KeepAliveResponse(lease_ms=int(lease_s * 1000), store_healthy=store_healthy)


def close_response() -> pb.CloseSessionResponse:
    """A closed session."""
    return pb.CloseSessionResponse()


def save_response(out: SaveOutcome) -> pb.SaveResponse:
    """What a save did."""
    return pb.SaveResponse(
        written=out.written,
        skipped=out.skipped,
        failed=len(out.failures),
        striped_to_others=out.striped_to_others,
        bytes_written=out.bytes_written,
        failures=failures(out.failures),
        absent=out.absent,
        retained=out.retained,
        unretained=out.unretained,
    )


def lookup_response(hit: Hit) -> pb.LookupResponse:
    """A lookup's hit."""
    return hit_to_message(hit)


def load_response(out: LoadOutcome) -> pb.LoadResponse:
    """What a load did."""
    return pb.LoadResponse(
        loaded=out.loaded,
        bytes_loaded=out.bytes_loaded,
        failures=failures(out.failures),
        retained=out.retained,
        unretained=out.unretained,
    )


def reset_response(removed: int) -> pb.ResetResponse:
    """How many values a reset removed."""
    return pb.ResetResponse(removed=removed)


def stats_response(
    uptime_seconds: float,
    health: StoreHealth,
    master_address: str,
    sessions: Sequence[SessionSummary],
    counters: dict[str, float],
    tenancy: str = "",
    caller_tenant: str = "",
    listeners: Sequence[tuple[Listener, int]] = (),
    gpu: str = "",
    gpu_failure: str = "",
) -> pb.StatsResponse:
    """The daemon's state for operators, with every listener and the packets it refused, and the GPU path's."""
    return pb.StatsResponse(
        daemon_version=__version__,
        uptime_seconds=uptime_seconds,
        store_healthy=health.healthy,
        store_detail=health.detail,
        master_address=master_address,
        sessions=[session_info(s) for s in sessions],
        counters=counters,
        tenancy=tenancy,
        caller_tenant=caller_tenant,
        listeners=[
            pb.ListenerInfo(role=item.role, address=item.address, allowed=item.allowed, dropped_packets=drops)
            for item, drops in listeners
        ],
        gpu=gpu,
        gpu_failure=gpu_failure,
    )


def session_info(s: SessionSummary) -> pb.SessionInfo:
    """One open session, as Stats shows it."""
    return pb.SessionInfo(
        session_id_prefix=s.id_prefix,
        role=ROLE_TO_PB[s.role],
        model=s.model,
        cache_prefix=s.cache_prefix,
        parallel=parallel_to_message(s.parallel),
        mapped_bytes=s.mapped_bytes,
        age_seconds=s.age_seconds,
        client_name=s.client_name,
        tenant=s.tenant,
        data_connections=s.data_connections,
    )
