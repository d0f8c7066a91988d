"""What a session tells the daemon about its engine: parallel layout, KV-cache groups, identity, role."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_contract import placement
from kvsidecar_contract.kinds import PROTO_OF_KIND
from kvsidecar_contract.limits import MAX_GROUPS, MAX_NAME_CHARS
from kvsidecar_contract.mapping import parallel_to_message, to_message
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["KINDS", "MAX_GROUPS", "ROLES", "EngineLayout", "GroupSpec", "SessionSpec"]

# The group kinds of the wire contract, by the names docs/placement.md uses.
KINDS: dict[str, pb.GroupKind] = {kind.value: value for kind, value in PROTO_OF_KIND.items()}

ROLES: dict[str, pb.Role] = {"rank": pb.ROLE_RANK, "scheduler": pb.ROLE_SCHEDULER}

_U32 = 2**32 - 1
_T = TypeVar("_T")


def _check_int(name: str, value: int) -> None:
    # bool is an int; a True tp_size is a bug in the caller, not a size of 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")


def _check_u32(name: str, value: int, low: int = 0) -> None:
    # Only for fields the placement rules do not bound: the wire carries them as uint32.
    _check_int(name, value)
    if not low <= value <= _U32:
        raise InvalidRequest(f"{name} must be in [{low}, {_U32}], got {value}")


def _contract(build: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Build a contract value; its refusal becomes the client's InvalidRequest with the daemon's own message."""
    try:
        return build(*args, **kwargs)
    except placement.PlacementError as error:
        raise InvalidRequest(str(error)) from None


class EngineLayout(placement.Parallel):
    """Parallel sizes and ranks of one engine rank: TP (T, r), PP (P, p), PCP (C, c) and DCP (D, d).

    The contract's Parallel, checked as the client's input: dcp_rank is the rank in its DCP group as the engine's
    parallel state says; None (or -1) lets the daemon derive it, and the wire then leaves it unset.
    """

    __slots__ = ("derives_dcp_rank",)
    derives_dcp_rank: bool

    def __init__(
        self,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        pcp_size: int = 1,
        pcp_rank: int = 0,
        dcp_size: int = 1,
        dcp_rank: int | None = None,
    ) -> None:
        sizes = (tp_size, tp_rank, pp_size, pp_rank, pcp_size, pcp_rank, dcp_size)
        for name, value in zip(_PARALLEL_FIELDS, sizes, strict=True):
            _check_int(name, value)
        derive = dcp_rank is None or dcp_rank == -1
        if not derive:
            _check_u32("dcp_rank", dcp_rank)  # type: ignore[arg-type]
        object.__setattr__(self, "derives_dcp_rank", derive)
        # Which (T, C, D) vLLM accepts and each rank's DCP rank are the contract's rules (Parallel).
        _contract(super().__init__, *sizes, -1 if derive else dcp_rank)

    def __reduce__(self) -> tuple[type[EngineLayout], tuple[int | None, ...]]:
        # The dataclass's pickled state holds its fields only, not whether the DCP rank was derived.
        sizes = tuple(getattr(self, name) for name in _PARALLEL_FIELDS)
        return (EngineLayout, (*sizes, None if self.derives_dcp_rank else self.dcp_rank))

    def to_proto(self) -> pb.ParallelLayout:
        """The contract's ParallelLayout message."""
        return parallel_to_message(self, derive_dcp_rank=self.derives_dcp_rank)


_PARALLEL_FIELDS = ("tp_size", "tp_rank", "pp_size", "pp_rank", "pcp_size", "pcp_rank", "dcp_size")


# One KV-cache group: the contract's own value (kinds by the names docs/placement.md uses, `GroupSpec("mla", 16)`);
# bad input is refused with the contract's InvalidLayout (a ValueError).
GroupSpec = placement.GroupSpec


@dataclass(frozen=True)
class SessionSpec:
    """Everything OpenSession says about one engine rank or scheduler; re-sent unchanged on every reconnect.

    The fields are the engine's words for it; the contract's Layout of the rank is built from them once, here, and
    checked by the daemon's own rules (`placement_layout`): everything the session derives reads that one value.
    """

    model: str
    layout: EngineLayout
    num_kv_heads: int
    hash_block_size: int
    groups: tuple[GroupSpec, ...]
    cache_prefix: str = ""
    role: str = "rank"
    hash_bytes: int = 32
    client_name: str = ""
    # The engine's own hit alignment and fine-grained rule (0 / None: the daemon derives them).
    hit_alignment_tokens: int = 0
    fine_grained_hits: bool | None = None
    value_identity: str = ""
    # Store the groups that allow it for every TP size (docs/placement.md rules 11, 12): True cuts attention values
    # per KV head and described recurrent state per head and per B/C group (any TP size reads them), an int N as a
    # TP=N engine holds its heads (fewer, larger values; every TP size that shares must divide N). Every session of
    # an engine must agree; the KV heads of head-split groups' tensors must be the outermost dim of a block.
    share_across_tp: bool | int = False
    placement_layout: placement.Layout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        _contract(placement.check_share_across_tp, self.share_across_tp)
        if self.role not in ROLES:
            raise InvalidRequest(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        for name in ("model", "cache_prefix", "value_identity"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"{name} must be a str, got {getattr(self, name)!r}")
        if len(self.value_identity) > MAX_NAME_CHARS:
            raise InvalidRequest(f"value_identity is longer than {MAX_NAME_CHARS} characters")
        _check_int("num_kv_heads", self.num_kv_heads)
        if self.num_kv_heads > _U32:  # the contract bounds it from below only; the wire carries a uint32
            raise InvalidRequest(f"num_kv_heads must be at most {_U32}, got {self.num_kv_heads}")
        _check_int("hash_block_size", self.hash_block_size)
        _check_u32("hash_bytes", self.hash_bytes, 1)
        _check_u32("hit_alignment_tokens", self.hit_alignment_tokens)
        if self.fine_grained_hits is not None and not isinstance(self.fine_grained_hits, bool):
            raise InvalidRequest(f"fine_grained_hits must be a bool or None, got {self.fine_grained_hits!r}")
        if not isinstance(self.layout, EngineLayout):
            raise InvalidRequest(f"layout must be an EngineLayout, got {type(self.layout).__name__}")
        if len(self.groups) > MAX_GROUPS:
            raise InvalidRequest(f"at most {MAX_GROUPS} KV-cache groups per session, got {len(self.groups)}")
        for index, group in enumerate(self.groups):
            if not isinstance(group, placement.GroupSpec):
                raise InvalidRequest(f"group {index} must be a GroupSpec, got {type(group).__name__}")
        # Names, heads, U and how every block span aligns with U: the daemon's own rules, refused before connecting.
        layout = _contract(
            placement.Layout,
            model=self.model,
            groups=self.groups,
            parallel=self.layout,
            num_kv_heads=self.num_kv_heads,
            hash_block_size=self.hash_block_size,
            cache_prefix=self.cache_prefix,
            hit_alignment_tokens=self.hit_alignment_tokens,
            fine_grained_hits=self.fine_grained_hits,
            value_identity=self.value_identity,
            share_tp_size=self.share_tp_size,
        )
        object.__setattr__(self, "placement_layout", layout)

    def to_placement(self) -> placement.Layout:
        """The contract's Layout of this session's rank, validated by the daemon's rules."""
        return self.placement_layout

    @property
    def share_tp_size(self) -> int:
        """The wire's share_tp_size (rules 11, 12): 0 (per layout), the TP size given, or for True the least N that
        cuts every shared value finest: the KV heads and every recurrent state axis, the same at every TP size."""
        return placement.share_tp_size_of(self.share_across_tp, self.num_kv_heads, self.groups)

    def cuts(self) -> list[tuple[int, int]]:
        """Per group, (values this rank stores per block, its KV heads) as its regions must declare them: more than
        one value where a group is cut by KV heads to be shared across TP sizes (rule 11). A group whose recurrent
        state is cut in pieces (rule 12) registers whole layers and declares no heads: the daemon cuts it from the
        state layout the session sent, so it is (1, 1) here."""
        layout = self.placement_layout
        return [
            (1, 1) if spec.state is not None else (layout.values_per_block(g), layout.kv_heads_of_rank())
            for g, spec in enumerate(layout.groups)
        ]

    @property
    def is_scheduler(self) -> bool:
        """A scheduler session has no memory and only looks up."""
        return self.role == "scheduler"

    def to_proto(self) -> pb.OpenSessionRequest:
        """The contract's OpenSessionRequest message."""
        return _contract(
            to_message,
            self.placement_layout,
            role=ROLES[self.role],
            hash_bytes=self.hash_bytes,
            client_name=self.client_name,
            derive_dcp_rank=self.layout.derives_dcp_rank,
        )
