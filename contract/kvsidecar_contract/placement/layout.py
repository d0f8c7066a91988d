"""The engine layout as frozen values: group kinds, parallel ranks, and their validation."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.keys import DEFAULT_CHECKSUM_EVERY, model_key, value_id
from kvsidecar_contract.placement.state import RecurrentState, StateCut

# Limits far past any real engine that keep every derived value (spans, alignment, namespaces) small: an absurd
# layout is refused at once instead of costing the daemon seconds and gigabytes.
MAX_TP = 1024
MAX_PP = 256
MAX_PCP = 256
MAX_BLOCK_TOKENS = 1 << 24
MAX_TOKENS = (1 << 31) - 1  # spans, windows and hit alignment units


class Kind(str, enum.Enum):
    """The kind of one KV-cache group (or of one member of a uniform group)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    UNIFORM = "uniform"

    def __str__(self) -> str:
        # The name docs and `--groups` use, as a str would print: `mla`, not `Kind.MLA`.
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def recurrent(self) -> bool:
        """State that is sharded by head/dim and stored per boundary, never as token blocks."""
        return self is Kind.MAMBA

    @property
    def latent(self) -> bool:
        """MLA kinds: the latent is replicated on every TP rank."""
        return self in (Kind.MLA, Kind.SLIDING_WINDOW_MLA)

    @property
    def sliding(self) -> bool:
        """Attention that only needs the last `window` tokens."""
        return self in (Kind.SLIDING_WINDOW, Kind.SLIDING_WINDOW_MLA)


def kind_of(name: str, what: str = "group kind", where: str = "") -> Kind:
    """The Kind spelled `name` (as in `--groups`, docs/placement.md and the client), or InvalidLayout listing the
    known ones."""
    try:
        return Kind(name)
    except ValueError:
        known = ", ".join(k.value for k in Kind)
        at = f" in {where!r}" if where else ""
        raise InvalidLayout(f"unknown {what} {name!r}{at} (known: {known})") from None


def _check_int(name: str, value: object) -> None:
    # bool is an int; a True block size is a bug in the caller, not a size of 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidLayout(f"{name} must be an int, got {value!r}")


@dataclass(frozen=True, slots=True, eq=False, init=False)
class GroupSpec:
    """One KV-cache group: its kind, tokens per physical block, window, members if uniform, and its state's layout.

    Kinds are given as Kind or by the names docs/placement.md uses (`GroupSpec("mla", 16)`, as engines write them).
    state describes one layer's recurrent state (every layer of the group alike) for a group whose members are all
    recurrent: what rule 12 needs to store it in pieces any TP size reads. Without it a recurrent group is kept
    per layout (rule 11).
    """

    kind: Kind
    block_size: int
    window: int
    inner: tuple[Kind, ...]
    state: RecurrentState | None

    def __init__(
        self,
        kind: Kind | str,
        block_size: int,
        window: int = 0,
        inner: Sequence[Kind | str] = (),
        state: RecurrentState | None = None,
    ) -> None:
        object.__setattr__(self, "kind", kind_of(kind) if isinstance(kind, str) else kind)
        # Any sequence of members, stored as a tuple: the spec stays hashable and immutable.
        members = tuple(kind_of(m, "member kind") if isinstance(m, str) else m for m in inner)
        object.__setattr__(self, "inner", members)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "state", state)
        self._check()

    def _check(self) -> None:
        for name in ("block_size", "window"):
            _check_int(name, getattr(self, name))
        if not isinstance(self.kind, Kind) or not all(isinstance(k, Kind) for k in self.inner):
            raise InvalidLayout(f"group kinds must be Kind or their names, got {self.kind!r} and {self.inner!r}")
        if not 1 <= self.block_size <= MAX_BLOCK_TOKENS:
            raise InvalidLayout(f"block_size must be in [1, {MAX_BLOCK_TOKENS}], got {self.block_size}")
        if self.window > MAX_TOKENS:
            raise InvalidLayout(f"window must be at most {MAX_TOKENS} tokens, got {self.window}")
        if self.kind is Kind.UNIFORM:
            if not self.inner:
                raise InvalidLayout("a uniform group needs at least one member kind")
            if Kind.UNIFORM in self.inner:
                raise InvalidLayout("uniform groups nest one level only: a member cannot be uniform")
        elif self.inner:
            raise InvalidLayout(f"only uniform groups have members, not {self.kind.value}")
        has_sliding = any(k.sliding for k in self.members)
        if has_sliding and self.window < 1:
            raise InvalidLayout(f"{self.describe()}: a sliding-window group needs window >= 1")
        if not has_sliding and self.window:
            raise InvalidLayout(f"{self.describe()}: window is only for sliding-window kinds")
        if self.state is not None and not isinstance(self.state, RecurrentState):
            raise InvalidLayout(f"state must be a RecurrentState, got {type(self.state).__name__}")
        if self.state is not None and not all(k.recurrent for k in self.members):
            raise InvalidLayout(
                f"{self.describe()}: a state layout describes recurrent state; only a group whose members are all "
                "recurrent has one"
            )

    def _fields(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.window, self.inner, self.state)

    def __eq__(self, other: object) -> bool:
        return self._fields() == other._fields() if isinstance(other, GroupSpec) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._fields())

    @property
    def members(self) -> tuple[Kind, ...]:
        """The kinds whose rules apply: the members of a uniform group, else the kind itself."""
        return self.inner if self.kind is Kind.UNIFORM else (self.kind,)

    @property
    def recurrent(self) -> bool:
        """Any recurrent member makes the whole packed value rank-specific and boundary-exact."""
        return any(k.recurrent for k in self.members)

    @property
    def attention(self) -> bool:
        """Any member that stores token blocks (full, sliding or MLA attention)."""
        return any(not k.recurrent for k in self.members)

    @property
    def gqa(self) -> bool:
        """Any ordinary (non-latent) attention member, whose heads are split across TP ranks."""
        return any(not k.recurrent and not k.latent for k in self.members)

    @property
    def head_split(self) -> bool:
        """Every member is ordinary attention (full or sliding, not MLA): its bytes are whole KV heads per rank."""
        return all(not k.recurrent and not k.latent for k in self.members)

    @property
    def shareable(self) -> bool:
        """Values any TP size can read (rules 11, 12): whole KV heads, an MLA latent every rank holds alike, or
        recurrent state whose layout says which bytes belong to which head and group.

        Recurrent state without its layout (sliced by head and by dim in ways the daemon cannot see) and a uniform
        group mixing MLA with ordinary attention (one value holds both, sliced differently) stay per layout.
        """
        return self.head_split or all(k.latent for k in self.members) or self.state is not None

    @property
    def attention_window(self) -> int | None:
        """Tokens of history the attention members need: None for all of them, else the widest window."""
        attn = [k for k in self.members if not k.recurrent]
        if not attn or any(not k.sliding for k in attn):
            return None
        return self.window

    def describe(self) -> str:
        """The group in the `--groups` syntax, e.g. `uniform(mla+full_attention)` or `sliding_window:4096`; a group
        with a state layout shows its axes instead of the layer's parameters: `mamba[heads=64,groups=8]`."""
        if self.kind is Kind.UNIFORM:
            body = "+".join(f"{k.value}:{self.window}" if k.sliding else k.value for k in self.inner)
            text = f"uniform({body})"
        else:
            text = f"{self.kind.value}:{self.window}" if self.kind.sliding else self.kind.value
        return f"{text}[{self.state.describe()}]" if self.state is not None else text

    def meaning(self) -> list[object]:
        """What the value id digests of the group: kind, block size, window, members, and its state's layout."""
        fields: list[object] = [self.kind.value, self.block_size, self.window, [k.value for k in self.inner]]
        # Only where there is one, so every value id of a group without a state layout stays what it was.
        return [*fields, self.state.meaning()] if self.state is not None else fields


def dcp_rank_of(tp_rank: int, pcp_rank: int, tp_size: int, pcp_size: int, dcp_size: int) -> int:
    """The DCP rank vLLM's parallel state gives TP rank r on PCP rank c: rank_in_group of its DCP group.

    vLLM lays ranks out as PP x PCP x TP and builds DCP groups over the (TP, PCP) plane with PCP varying fastest
    (`initialize_model_parallel`: all_ranks.transpose(-1, -2).reshape(-1, D)), so the rank is (r * C + c) mod D.
    Without PCP that is r mod D; with D = C it is c; with D = T * C every rank has its own.
    """
    return (tp_rank * pcp_size + pcp_rank) % dcp_size if dcp_size > 1 else 0


def check_dcp_size(tp_size: int, pcp_size: int, dcp_size: int) -> None:
    """Refuse a DCP size vLLM's ParallelConfig refuses: D divides T without PCP, D in {1, C, T * C} with it."""
    if dcp_size < 1:
        raise InvalidLayout(f"dcp_size must be >= 1, got {dcp_size}")
    if pcp_size == 1:
        if tp_size % dcp_size:
            raise InvalidLayout(f"dcp_size {dcp_size} must divide tp_size {tp_size} (DCP reuses the TP ranks)")
    elif dcp_size not in (1, pcp_size, tp_size * pcp_size):
        raise InvalidLayout(
            f"with pcp_size {pcp_size}, dcp_size must be 1, pcp_size or tp_size * pcp_size "
            f"({sorted({1, pcp_size, tp_size * pcp_size})}), got {dcp_size}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class Parallel:
    """Parallel sizes and ranks of one engine rank: TP (T, r), PP (P, p), PCP (C, c) and DCP (D, d).

    dcp_rank is what the engine's parallel state says (-1: derive it with dcp_rank_of); a rank that disagrees
    with vLLM's layout is refused, since its keys would be in a namespace no lookup asks for.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = -1

    def __post_init__(self) -> None:
        for name, size, rank, most in (
            ("tp", self.tp_size, self.tp_rank, MAX_TP),
            ("pp", self.pp_size, self.pp_rank, MAX_PP),
            ("pcp", self.pcp_size, self.pcp_rank, MAX_PCP),
        ):
            if not 1 <= size <= most:
                raise InvalidLayout(f"{name}_size must be in [1, {most}], got {size}")
            if not 0 <= rank < size:
                raise InvalidLayout(f"{name}_rank must be in [0, {size}), got {rank}")
        check_dcp_size(self.tp_size, self.pcp_size, self.dcp_size)
        expected = dcp_rank_of(self.tp_rank, self.pcp_rank, self.tp_size, self.pcp_size, self.dcp_size)
        if self.dcp_rank == -1:
            object.__setattr__(self, "dcp_rank", expected)
        elif self.dcp_rank != expected:
            raise InvalidLayout(
                f"dcp_rank {self.dcp_rank} is not the DCP rank of tp_rank {self.tp_rank} on pcp_rank {self.pcp_rank} "
                f"with (tp, pcp, dcp) sizes ({self.tp_size}, {self.pcp_size}, {self.dcp_size}): vLLM's parallel "
                f"state gives {expected}"
            )

    def _fields(self) -> tuple[int, ...]:
        sizes = (self.tp_size, self.pp_size, self.pcp_size, self.dcp_size)
        return (*sizes, self.tp_rank, self.pp_rank, self.pcp_rank, self.dcp_rank)

    # A value, whatever class holds it: the client's EngineLayout equals the contract's Parallel of the same ranks.
    def __eq__(self, other: object) -> bool:
        return self._fields() == other._fields() if isinstance(other, Parallel) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._fields())

    def dcp_rank_at(self, tp_rank: int, pcp_rank: int) -> int:
        """The DCP rank of another rank of the same engine."""
        return dcp_rank_of(tp_rank, pcp_rank, self.tp_size, self.pcp_size, self.dcp_size)


def check_share_across_tp(share_across_tp: object) -> bool | int:
    """The engine's `share_across_tp` (client and connector setting), or InvalidLayout: true, false or a TP size."""
    if not isinstance(share_across_tp, int) or (not isinstance(share_across_tp, bool) and share_across_tp < 1):
        raise InvalidLayout(f"share_across_tp must be true, false or a TP size >= 1, got {share_across_tp!r}")
    return share_across_tp


def share_tp_size_of(share_across_tp: bool | int, num_kv_heads: int, groups: Sequence[GroupSpec] = ()) -> int:
    """Rules 11 and 12: the Layout's share_tp_size of an engine's `share_across_tp`: 0 (false: per layout), an int N
    as given (values cut as a TP=N engine holds them), or for true the least N that cuts every shared value finest,
    one per index: the KV heads and every recurrent state axis of `groups` (capped at MAX_TP). True never depends on
    the engine's TP size, so every TP size sends the same N."""
    share = check_share_across_tp(share_across_tp)
    if not isinstance(share, bool):
        return share
    if not share:
        return 0
    axes = [axis.size for group in groups if group.state is not None for axis in group.state.axes]
    return min(max([num_kv_heads, *axes]), MAX_TP)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything placement needs to know about one engine rank."""

    model: str
    groups: tuple[GroupSpec, ...]
    parallel: Parallel = Parallel()
    num_kv_heads: int = 1
    hash_block_size: int = 16
    cache_prefix: str = ""
    # vLLM's own hit alignment and fine-grained rule (its KV-cache config), or 0 / None: derive them (rule 9).
    hit_alignment_tokens: int = 0
    fine_grained_hits: bool | None = None
    value_identity: str = ""  # the client's digest of what its bytes mean (docs/values.md)
    # Rule 11: store shareable groups at a granularity no single TP size decides, so engines of other TP sizes read
    # them: attention cut as a TP=share_tp_size engine holds its KV heads (any N >= H: one value per head), the MLA
    # latent once. 0: per layout. Every session of an engine, scheduler included, must agree.
    share_tp_size: int = 0
    # Which values end with a checksum trailer: one key in N (1: all, 0: none). Not the client's to choose: the
    # daemon sets its --checksums on every session. Part of the value id: the bytes under a key differ with it.
    checksum_every: int = DEFAULT_CHECKSUM_EVERY

    def __post_init__(self) -> None:
        if not self.model_name:
            raise InvalidLayout(f"model name {self.model!r} has no last path component")
        # '@' separates key fields: letting it into a name would let one tenant forge another's keys.
        if "@" in self.model_name:
            raise InvalidLayout(f"model name must not contain '@': {self.model!r}")
        if "@" in self.cache_prefix:
            raise InvalidLayout(f"cache_prefix must not contain '@': {self.cache_prefix!r}")
        if self.checksum_every < 0:
            raise InvalidLayout(f"checksum_every must be >= 0, got {self.checksum_every}")
        if self.num_kv_heads < 1:
            raise InvalidLayout(f"num_kv_heads must be >= 1, got {self.num_kv_heads}")
        if not 1 <= self.hash_block_size <= MAX_BLOCK_TOKENS:
            raise InvalidLayout(f"hash_block_size must be in [1, {MAX_BLOCK_TOKENS}], got {self.hash_block_size}")
        if not self.groups:
            raise InvalidLayout("a layout needs at least one KV-cache group")
        for index, group in enumerate(self.groups):
            # What must align with U is the span: under DCP an attention block covers block_size * D tokens.
            span = group.block_size if group.recurrent else group.block_size * self.parallel.dcp_size
            if span > MAX_TOKENS:
                raise InvalidLayout(
                    f"group {index} ({group.describe()}): a block spans {span} tokens, past {MAX_TOKENS}"
                )
            if span % self.hash_block_size:
                raise InvalidLayout(
                    f"group {index} ({group.describe()}): a block spans {span} tokens (block_size "
                    f"{group.block_size}), not a multiple of hash_block_size {self.hash_block_size}"
                )
        tp, heads = self.parallel.tp_size, self.num_kv_heads
        if any(g.gqa for g in self.groups) and heads % tp and tp % heads:
            raise InvalidLayout(f"num_kv_heads {heads} and tp_size {tp} must divide one another")
        for index, group in enumerate(self.groups):
            if group.state is not None:
                try:
                    group.state.check_tp(tp)
                except InvalidLayout as exc:
                    raise InvalidLayout(f"group {index} ({group.describe()}): {exc}") from None
        self._check_sharing()
        u, unit = self.hash_block_size, self.hit_alignment_tokens
        if unit and (unit % u or unit > MAX_TOKENS):
            raise InvalidLayout(
                f"hit_alignment_tokens {unit} must be a multiple of hash_block_size {u}, at most {MAX_TOKENS}"
            )
        if unit and self.fine_grained_hits and unit != u:
            raise InvalidLayout(
                f"fine-grained hits land on every hash block: hit_alignment_tokens must be hash_block_size {u}, "
                f"got {unit}"
            )

    def _check_sharing(self) -> None:
        n = self.share_tp_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TP:
            raise InvalidLayout(f"share_tp_size must be an int in [0, {MAX_TP}], got {n!r}")
        if not n:
            return
        par = self.parallel
        if par.dcp_size > 1 or par.pcp_size > 1:
            raise InvalidLayout(
                "sharing values across TP sizes is not defined under DCP or PCP: a rank's block then holds an "
                "interleaved slice of the tokens, which another layout slices otherwise (open the session without it)"
            )
        for index, group in enumerate(self.groups):
            if group.state is not None:
                try:
                    group.state.check_cut(n, par.tp_size)
                except InvalidLayout as exc:
                    raise InvalidLayout(f"group {index} ({group.describe()}): {exc}") from None
        if not any(self.shared(g) and spec.head_split for g, spec in enumerate(self.groups)):
            return
        heads, tp, parts = self.num_kv_heads, par.tp_size, self.head_groups
        if heads % parts:
            raise InvalidLayout(
                f"share_tp_size {n} would cut {heads} KV heads into {parts} equal values: it must divide them "
                f"(or be at least {heads}: one value per head)"
            )
        if not (parts % tp == 0 if tp <= parts else parts == heads):
            raise InvalidLayout(
                f"share_tp_size {n} stores values of {heads // parts} KV heads; a TP={tp} rank holds "
                f"{max(1, heads // tp)}, not a whole number of them: every TP size that shares must divide "
                f"share_tp_size (or use one value per head: share_tp_size >= {heads})"
            )

    @property
    def head_groups(self) -> int:
        """Rule 11: values one block of a shared head-split group is cut into across all ranks (H/G heads each)."""
        return min(self.num_kv_heads, self.share_tp_size) if self.share_tp_size else 1

    def for_rank(self, tp_rank: int, pcp_rank: int = 0, pp_rank: int = 0) -> Layout:
        """The same engine seen from another rank."""
        par = replace(self.parallel, tp_rank=tp_rank, pcp_rank=pcp_rank, pp_rank=pp_rank, dcp_rank=-1)
        return replace(self, parallel=par)

    @property
    def model_name(self) -> str:
        """The last path component of the model's name."""
        return model_key(self.model)

    @property
    def value_id(self) -> str:
        """What this engine's values mean: the client's identity and everything here that shapes a shard's bytes."""
        par = self.parallel
        session = {
            "groups": [g.meaning() for g in self.groups],
            "num_kv_heads": self.num_kv_heads,
            "hash_block_size": self.hash_block_size,
            "parallel": [par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        }
        return value_id(self.value_identity, session, self.checksum_every)

    def shared(self, group: int) -> bool:
        """Whether the group's values are stored for every TP size (rule 11)."""
        return bool(self.share_tp_size) and self.groups[group].shareable

    def values_of_rank(self, group: int, tp_rank: int) -> Sequence[int]:
        """Rules 11, 12: which values of a shared group a rank holds, in order.

        Head-split (rule 11): of the head_groups values, a rank of T <= G holds G/T consecutive ones; a rank of
        T > G (then G = H: one value per head) holds the one head its replica set shares. Recurrent state (rule 12):
        the pieces of every axis it holds whole, axis after axis.
        """
        state = self.groups[group].state
        if state is not None and self.shared(group):
            return state.own_pieces(self.share_tp_size, self.parallel.tp_size, tp_rank)
        parts, tp = self.head_groups, self.parallel.tp_size
        if tp <= parts:
            per = parts // tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        first = tp_rank // (tp // parts)
        return range(first, first + 1)

    def values_per_block(self, group: int) -> int:
        """Rules 11, 12: values one block of the group makes on this rank: G/T where shared by KV head, the rank's
        pieces where its state is shared, else 1."""
        spec = self.groups[group]
        if not (self.shared(group) and (spec.head_split or spec.state is not None)):
            return 1
        return len(self.values_of_rank(group, self.parallel.tp_rank))

    def value_cut(self, group: int) -> tuple[int, int] | StateCut:
        """How this rank's blocks of a group become its values (what the daemon maps to addresses).

        A shared recurrent group: its StateCut (rule 12). Otherwise (values per block, KV heads of the rank): that
        many equal head-major parts of every region (rule 11), or with one value per block, the whole block.
        """
        state = self.groups[group].state
        if state is not None and self.shared(group):
            return state.cut(self.share_tp_size, self.parallel.tp_size, self.parallel.tp_rank)
        return self.values_per_block(group), self.kv_heads_of_rank()

    def kv_heads_of_rank(self) -> int:
        """KV heads one rank holds of ordinary attention: H/T, or one replicated head when T > H."""
        return max(1, self.num_kv_heads // self.parallel.tp_size)

    def group_value_id(self, group: int) -> str:
        """The value id of one group's keys: the session's, or without the TP size where the group is shared.

        A shared group's value (H/G KV heads of a block, or the MLA latent) has the same bytes at every TP size, so
        its id leaves T out and says how the value is cut; the other groups keep the session's id, T included.
        """
        if not self.shared(group):
            return self.value_id
        par, g = self.parallel, self.groups[group]
        if g.state is not None:
            # Rule 12: a piece's bytes depend on the state's layout and on the cut (which indices it holds), not on
            # T and not on KV heads; `state:` can never equal rule 11's `kv_heads:` or `latent`.
            cut = sorted({(p.axis, p.length) for p in g.state.pieces(self.share_tp_size)})
            session = {
                "group": [group, *g.meaning()],
                "hash_block_size": self.hash_block_size,
                "parallel": ["any", par.pp_size, par.pcp_size, par.dcp_size],
                "value": ["state", cut],
            }
            return value_id(self.value_identity, session, self.checksum_every)
        # Only what decides this group's bytes: another group's block size may follow T (a hybrid's attention
        # blocks sized to its per-rank Mamba state) without changing what one head of this group's block holds.
        session = {
            "group": [group, g.kind.value, g.block_size, g.window, [k.value for k in g.inner]],
            "num_kv_heads": self.num_kv_heads,
            "hash_block_size": self.hash_block_size,
            "parallel": ["any", par.pp_size, par.pcp_size, par.dcp_size],
            "value": f"kv_heads:{self.num_kv_heads // self.head_groups}" if g.head_split else "latent",
        }
        return value_id(self.value_identity, session, self.checksum_every)

    @property
    def model_key(self) -> str:
        """The model's field in keys: the last path component of its name, then `~` and the value id."""
        return f"{self.model_name}~{self.value_id}"

    def group_model_key(self, group: int) -> str:
        """The model's field in one group's keys: `<model>~<that group's value id>`."""
        return f"{self.model_name}~{self.group_value_id(group)}"
