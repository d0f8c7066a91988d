"""What a session tells the daemon about its engine: parallel layout, KV-cache groups, identity, role."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_contract.limits import MAX_GROUPS, MAX_NAME_CHARS
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["KINDS", "MAX_GROUPS", "ROLES", "EngineLayout", "GroupSpec", "SessionSpec"]

# The group kinds of the wire contract, by the names PLACEMENT.md uses.
KINDS: dict[str, pb.GroupKind] = {
    "full_attention": pb.FULL_ATTENTION,
    "sliding_window": pb.SLIDING_WINDOW,
    "mla": pb.MLA,
    "sliding_window_mla": pb.SLIDING_WINDOW_MLA,
    "mamba": pb.MAMBA,
    "uniform": pb.UNIFORM,
}
_SLIDING = frozenset({"sliding_window", "sliding_window_mla"})

ROLES: dict[str, pb.Role] = {"rank": pb.ROLE_RANK, "scheduler": pb.ROLE_SCHEDULER}

_U32 = 2**32 - 1


def _check_u32(name: str, value: int, low: int = 0) -> None:
    # bool is an int; a True tp_size is a bug in the caller, not a size of 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    if not low <= value <= _U32:
        raise InvalidRequest(f"{name} must be in [{low}, {_U32}], got {value}")


@dataclass(frozen=True)
class EngineLayout:
    """Parallel sizes and ranks of one engine rank: TP (T, r), PP (P, p), PCP (C, c) and DCP size D."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for name, size, rank in (
            ("tp", self.tp_size, self.tp_rank),
            ("pp", self.pp_size, self.pp_rank),
            ("pcp", self.pcp_size, self.pcp_rank),
        ):
            _check_u32(f"{name}_size", size, 1)
            _check_u32(f"{name}_rank", rank)
            if rank >= size:
                raise InvalidRequest(f"{name}_rank must be in [0, {size}), got {rank}")
        _check_u32("dcp_size", self.dcp_size, 1)
        if self.tp_size % self.dcp_size:
            raise InvalidRequest(f"dcp_size {self.dcp_size} must divide tp_size {self.tp_size}")

    def to_proto(self) -> pb.ParallelLayout:
        """The contract's ParallelLayout message."""
        return pb.ParallelLayout(
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            pcp_size=self.pcp_size,
            pcp_rank=self.pcp_rank,
            dcp_size=self.dcp_size,
        )


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: kind, tokens per physical block, window (sliding kinds), members (uniform)."""

    kind: str
    block_size: int
    window: int = 0
    inner: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # Accept any sequence for `inner` but store a tuple, so the spec stays hashable and immutable.
        object.__setattr__(self, "inner", tuple(self.inner))
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown group kind {self.kind!r}; expected one of {sorted(KINDS)}")
        _check_u32("block_size", self.block_size, 1)
        _check_u32("window", self.window)
        if self.kind == "uniform":
            if not self.inner:
                raise InvalidRequest("a uniform group needs at least one member kind in `inner`")
            for member in self.inner:
                if member not in KINDS:
                    raise InvalidRequest(f"unknown member kind {member!r} in a uniform group")
                if member == "uniform":
                    raise InvalidRequest("uniform groups nest one level only: a member cannot be uniform")
        elif self.inner:
            raise InvalidRequest(f"only uniform groups have members (`inner`), not {self.kind}")
        sliding = any(kind in _SLIDING for kind in self.members)
        if sliding and self.window < 1:
            raise InvalidRequest(f"group {self.kind}: a sliding-window kind needs window >= 1")
        if not sliding and self.window:
            raise InvalidRequest(f"group {self.kind}: window is only for sliding-window kinds")

    @property
    def members(self) -> tuple[str, ...]:
        """The kinds whose rules apply: the members of a uniform group, else the kind itself."""
        return self.inner if self.kind == "uniform" else (self.kind,)

    def to_proto(self) -> pb.KVCacheGroup:
        """The contract's KVCacheGroup message."""
        return pb.KVCacheGroup(
            kind=KINDS[self.kind],
            block_size=self.block_size,
            window=self.window,
            inner=[KINDS[kind] for kind in self.inner],
        )


@dataclass(frozen=True)
class SessionSpec:
    """Everything OpenSession says about one engine rank or scheduler; re-sent unchanged on every reconnect."""

    model: str
    layout: EngineLayout
    num_kv_heads: int
    hash_block_size: int
    groups: tuple[GroupSpec, ...]
    cache_prefix: str = ""
    role: str = "rank"
    hash_bytes: int = 32
    client_name: str = ""
    value_identity: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        model_key = self.model.rstrip("/").split("/")[-1]
        if not model_key:
            raise InvalidRequest(f"model name {self.model!r} has no last path component")
        # '@' separates the fields of a store key: the daemon refuses it, so say so before connecting.
        if "@" in model_key:
            raise InvalidRequest(f"model name must not contain '@': {self.model!r}")
        if "@" in self.cache_prefix:
            raise InvalidRequest(f"cache_prefix must not contain '@': {self.cache_prefix!r}")
        if len(self.value_identity) > MAX_NAME_CHARS:
            raise InvalidRequest(f"value_identity is longer than {MAX_NAME_CHARS} characters")
        if self.role not in ROLES:
            raise InvalidRequest(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        _check_u32("num_kv_heads", self.num_kv_heads, 1)
        _check_u32("hash_block_size", self.hash_block_size, 1)
        _check_u32("hash_bytes", self.hash_bytes, 1)
        if not isinstance(self.layout, EngineLayout):
            raise InvalidRequest(f"layout must be an EngineLayout, got {type(self.layout).__name__}")
        if not self.groups:
            raise InvalidRequest("a session needs at least one KV-cache group")
        if len(self.groups) > MAX_GROUPS:
            raise InvalidRequest(f"at most {MAX_GROUPS} KV-cache groups per session, got {len(self.groups)}")
        for index, group in enumerate(self.groups):
            if not isinstance(group, GroupSpec):
                raise InvalidRequest(f"group {index} must be a GroupSpec, got {type(group).__name__}")
            # How block sizes must align with hash_block_size is a placement rule (spans under DCP): the daemon
            # owns it and answers INVALID_ARGUMENT with the reason.

    @property
    def is_scheduler(self) -> bool:
        """A scheduler session has no memory and only looks up."""
        return self.role == "scheduler"

    def to_proto(self) -> pb.OpenSessionRequest:
        """The contract's OpenSessionRequest message."""
        return pb.OpenSessionRequest(
            engine=pb.EngineIdentity(
                model=self.model, cache_prefix=self.cache_prefix, value_identity=self.value_identity
            ),
            parallel=self.layout.to_proto(),
            num_kv_heads=self.num_kv_heads,
            hash_block_size=self.hash_block_size,
            groups=[group.to_proto() for group in self.groups],
            hash_bytes=self.hash_bytes,
            role=ROLES[self.role],
            client_name=self.client_name,
        )
