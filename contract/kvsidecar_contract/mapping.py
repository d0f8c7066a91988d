"""The contract's values on the wire: the session's shape (its Layout to an OpenSessionRequest and back) and a
lookup's Hit, one function each way.

The client sends what `to_message` makes and the daemon runs what `from_message` reads, so the two cannot drift: a
new field of the shape is added here once per direction (a group's in `group_to_message` / `group_from_message`).
What the message cannot say is refused with the reason (InvalidLayout), as the Layout refuses what it cannot be.
"""

from __future__ import annotations

from kvsidecar_contract.kinds import KIND_OF_PROTO, PROTO_OF_KIND
from kvsidecar_contract.limits import MAX_GROUPS, MAX_MODEL_CHARS, MAX_NAME_CHARS
from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.layout import GroupSpec, Layout, Parallel
from kvsidecar_contract.placement.lookup import Hit
from kvsidecar_contract.proto import sidecar_pb2 as pb
from kvsidecar_contract.state_wire import state_from_message, state_to_message

__all__ = [
    "from_message",
    "hit_from_message",
    "hit_to_message",
    "group_from_message",
    "group_to_message",
    "parallel_from_message",
    "parallel_to_message",
    "to_message",
]


def group_to_message(group: GroupSpec) -> pb.KVCacheGroup:
    """One KV-cache group as the wire carries it."""
    return pb.KVCacheGroup(
        kind=PROTO_OF_KIND[group.kind],
        block_size=group.block_size,
        window=group.window,
        inner=[PROTO_OF_KIND[kind] for kind in group.inner],
        state=None if group.state is None else state_to_message(group.state),
    )


def group_from_message(index: int, message: pb.KVCacheGroup) -> GroupSpec:
    """Group `index` of a request: its kinds must be set; the GroupSpec checks the rest."""
    if message.kind not in KIND_OF_PROTO:
        raise InvalidLayout(f"group {index}: kind must be set")
    if any(kind not in KIND_OF_PROTO for kind in message.inner):
        raise InvalidLayout(f"group {index}: member kinds must be set")
    inner = tuple(KIND_OF_PROTO[kind] for kind in message.inner)
    state = None
    if message.HasField("state"):
        try:
            state = state_from_message(message.state)
        except InvalidLayout as exc:
            raise InvalidLayout(f"group {index}: its recurrent state layout: {exc}") from None
    return GroupSpec(KIND_OF_PROTO[message.kind], message.block_size, message.window, inner, state)


def parallel_to_message(parallel: Parallel, *, derive_dcp_rank: bool = False) -> pb.ParallelLayout:
    """Parallel sizes and ranks as the wire carries them; derive_dcp_rank leaves dcp_rank for the daemon to derive."""
    return pb.ParallelLayout(
        tp_size=parallel.tp_size,
        tp_rank=parallel.tp_rank,
        pp_size=parallel.pp_size,
        pp_rank=parallel.pp_rank,
        pcp_size=parallel.pcp_size,
        pcp_rank=parallel.pcp_rank,
        dcp_size=parallel.dcp_size,
        dcp_rank=None if derive_dcp_rank else parallel.dcp_rank,
    )


def parallel_from_message(message: pb.ParallelLayout) -> Parallel:
    """Parallel of a request: unset sizes are 1, an unset dcp_rank is derived (Parallel checks the rest)."""
    dcp_size = message.dcp_size or 1
    given = message.HasField("dcp_rank")
    if given and message.dcp_rank >= dcp_size:
        raise InvalidLayout(f"dcp_rank must be in [0, dcp_size={dcp_size}), got {message.dcp_rank}")
    return Parallel(
        tp_size=message.tp_size,
        tp_rank=message.tp_rank,
        pp_size=message.pp_size or 1,
        pp_rank=message.pp_rank,
        pcp_size=message.pcp_size or 1,
        pcp_rank=message.pcp_rank,
        dcp_size=dcp_size,
        dcp_rank=message.dcp_rank if given else -1,
    )


def to_message(
    layout: Layout,
    *,
    role: pb.Role = pb.ROLE_RANK,
    hash_bytes: int = 32,
    client_name: str = "",
    derive_dcp_rank: bool = False,
) -> pb.OpenSessionRequest:
    """The OpenSessionRequest of one engine rank's (or scheduler's) layout."""
    return pb.OpenSessionRequest(
        engine=pb.EngineIdentity(
            model=layout.model, cache_prefix=layout.cache_prefix, value_identity=layout.value_identity
        ),
        parallel=parallel_to_message(layout.parallel, derive_dcp_rank=derive_dcp_rank),
        num_kv_heads=layout.num_kv_heads,
        hash_block_size=layout.hash_block_size,
        groups=[group_to_message(group) for group in layout.groups],
        hash_bytes=hash_bytes,
        role=role,
        client_name=client_name,
        hit_alignment_tokens=layout.hit_alignment_tokens,
        fine_grained_hits=layout.fine_grained_hits,
        share_tp_size=layout.share_tp_size,
    )


def from_message(request: pb.OpenSessionRequest) -> Layout:
    """The Layout an OpenSessionRequest describes (its role, hash size and client name are the caller's to read)."""
    for name, value, most in (
        ("model", request.engine.model, MAX_MODEL_CHARS),
        ("cache_prefix", request.engine.cache_prefix, MAX_NAME_CHARS),
        ("value_identity", request.engine.value_identity, MAX_NAME_CHARS),
    ):
        if len(value) > most:
            raise InvalidLayout(f"{name} is {len(value)} characters long, more than {most}")
    if not request.groups:
        raise InvalidLayout("a session needs at least one KV-cache group")
    if len(request.groups) > MAX_GROUPS:
        raise InvalidLayout(f"at most {MAX_GROUPS} KV-cache groups, got {len(request.groups)}")
    groups = tuple(group_from_message(index, group) for index, group in enumerate(request.groups))
    parallel = parallel_from_message(request.parallel)
    # The Layout states these rules too; here they are said in the wire's terms, where 0 means "derive it".
    unit, u = request.hit_alignment_tokens, request.hash_block_size
    if unit and u and unit % u:
        raise InvalidLayout(f"hit_alignment_tokens {unit} must be a multiple of hash_block_size {u} (0: derive it)")
    fine = request.fine_grained_hits if request.HasField("fine_grained_hits") else None
    if fine and unit and unit != u:
        raise InvalidLayout(
            f"fine_grained_hits lands hits on every hash block: hit_alignment_tokens must be hash_block_size {u} or "
            f"0, got {unit}"
        )
    return Layout(
        model=request.engine.model,
        groups=groups,
        parallel=parallel,
        num_kv_heads=request.num_kv_heads,
        hash_block_size=u,
        cache_prefix=request.engine.cache_prefix,
        hit_alignment_tokens=unit,
        fine_grained_hits=fine,
        value_identity=request.engine.value_identity,
        share_tp_size=request.share_tp_size,
    )


def hit_to_message(hit: Hit) -> pb.LookupResponse:
    """A lookup's answer as the wire carries it."""
    return pb.LookupResponse(
        hit_tokens=hit.hit_tokens, tail_boundaries=hit.tail_boundaries, degraded=hit.degraded, detail=hit.detail
    )


def hit_from_message(message: pb.LookupResponse) -> Hit:
    """A lookup's answer as the daemon sent it."""
    return Hit(message.hit_tokens, tuple(message.tail_boundaries), message.degraded, message.detail)
