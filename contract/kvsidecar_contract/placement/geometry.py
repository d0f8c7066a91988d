"""Rules 1, 2, 4, 6, 7, 9's alignment, 11 and 12: per-group facts derived once from a layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.keys import namespace_prefix
from kvsidecar_contract.placement.layout import GroupSpec, Layout, Parallel
from kvsidecar_contract.placement.spans import Spans, span

__all__ = [
    "MAX_NAMESPACES",
    "Geometry",
    "GroupGeometry",
    "byte_classes",
    "head_shard",
    "replication_factor",
    "span",
    "writes_chunk",
]

MAX_NAMESPACES = 1 << 16  # key prefixes a session precomputes, summed over its groups


def head_shard(group: GroupSpec, tp_rank: int, tp_size: int, num_kv_heads: int) -> int:
    """Which part of a group's bytes across TP a rank holds: equal exactly for ranks holding the same heads.

    Recurrent state is sharded by head and dim on every rank; the MLA latent is on every rank; ordinary attention
    heads are split over TP, each of them replicated on T/H consecutive ranks when T > H (vLLM's
    get_num_kv_heads: max(1, H // T) heads per rank).
    """
    if group.recurrent:
        return tp_rank
    if all(k.latent for k in group.members):
        return 0
    return tp_rank // max(1, tp_size // num_kv_heads)


def byte_classes(group: GroupSpec, par: Parallel, num_kv_heads: int) -> list[list[int]]:
    """The TP ranks of one PCP rank partitioned by identical bytes (rule 1), each class ascending.

    A rank holds its heads (head_shard) of its DCP slice of the sequence: vLLM's slot mapping puts token i on
    DCP rank (i // interleave) mod D, whatever DCP group the rank is in, so two ranks hold the same bytes iff they
    hold the same heads and the same DCP rank. The partition is the same on every PCP rank (the DCP rank depends on
    the PCP rank only through a constant when D is 1 or C, and is unique per rank when D = T * C).
    """
    classes: dict[tuple[int, int], list[int]] = {}
    for r in range(par.tp_size):
        key = (head_shard(group, r, par.tp_size, num_kv_heads), par.dcp_rank_at(r, 0))
        classes.setdefault(key, []).append(r)
    return sorted(classes.values())


def replication_factor(group: GroupSpec, tp_size: int, num_kv_heads: int, dcp_size: int) -> int:
    """Rule 1: how many TP ranks hold byte-identical bytes for this group (those of TP rank 0, without PCP)."""
    return len(byte_classes(group, Parallel(tp_size=tp_size, dcp_size=dcp_size), num_kv_heads)[0])


def writes_chunk(member: int, group: int, chunk: int, factor: int) -> bool:
    """Rule 4: inside a replication set exactly one rank writes each chunk; the writer rotates with g.

    member is the rank's index in its replication set (r mod f when the set is f consecutive ranks).
    """
    return chunk % factor == (member + group) % factor


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Derived placement facts of one group, for one rank."""

    index: int
    spec: GroupSpec
    factor: int  # ranks in this rank's replication set
    span: int
    shard: int  # this rank's shard id (rule 2): which heads it holds
    prefix: str  # this rank's own namespace
    lookup_prefixes: tuple[str, ...]  # every namespace a boundary must exist in (rule 7)
    member: int = 0  # this rank's index in its replication set (rule 4)
    fine: bool = False  # hits may end inside this group's blocks
    # Rules 11, 12: the namespaces of this rank's values of one block, in the order its bytes are cut: one per group
    # of KV heads it holds for a group shared across TP sizes (each region's block is that many head-major parts),
    # one per state piece it holds for a shared recurrent group, else (prefix,).
    parts: tuple[str, ...] = ()
    shared: bool = False  # values any TP size reads (rules 11, 12)
    # Rule 12: (ranks holding it, this rank's index among them) per part, where parts are striped apart: a state
    # piece an axis repeats over several ranks (vLLM's one B/C group at T > 1) is written by one of them. Empty:
    # every part is striped as the group is (factor, member).
    replicas: tuple[tuple[int, int], ...] = ()

    @property
    def own(self) -> tuple[str, ...]:
        """This rank's namespaces for the group, one per part of a block (rule 11)."""
        return self.parts or (self.prefix,)

    @property
    def keys_per_boundary(self) -> int:
        """Rule 7: namespaces that must all hold a boundary before it counts as stored."""
        return len(self.lookup_prefixes)

    def writes(self, chunk: int) -> bool:
        """Rule 4 for this rank: whether it writes the group's chunk `chunk`."""
        return writes_chunk(self.member, self.index, chunk, self.factor)

    def writes_part(self, part: int, chunk: int) -> bool:
        """Rule 4 per value: whether this rank writes its part `part` of the group's chunk `chunk`."""
        if not self.replicas:
            return self.writes(chunk)
        holders, member = self.replicas[part]
        return writes_chunk(member, self.index, chunk, holders)

    def writing(self, chunk: int) -> Sequence[int]:
        """The parts of chunk `chunk` this rank writes (rule 4): all of them or none, or per part (rule 12)."""
        if not self.replicas:
            return range(len(self.own)) if self.writes(chunk) else ()
        return [p for p in range(len(self.replicas)) if self.writes_part(p, chunk)]


@dataclass(frozen=True, slots=True)
class Geometry:
    """Everything placement derives from a layout, computed once per session."""

    layout: Layout
    groups: tuple[GroupGeometry, ...]
    fine_grained: bool
    unit: int  # hit lengths are multiples of this (rule 9)

    @classmethod
    def of(cls, layout: Layout) -> Geometry:
        """Derive the geometry of a validated layout."""
        par = layout.parallel
        partitions = [byte_classes(spec, par, layout.num_kv_heads) for spec in layout.groups]
        heads = layout.num_kv_heads
        # A group shared across TP sizes has one namespace per KV head (its lookup needs every head) when its bytes
        # are whole heads; every other group one per replication set.
        namespaces = sum(
            par.pcp_size * _namespaces(layout, g, spec, len(classes)) * par.pp_size
            for g, (spec, classes) in enumerate(zip(layout.groups, partitions, strict=True))
        )
        if namespaces > MAX_NAMESPACES:
            raise InvalidLayout(
                f"this layout needs {namespaces} key namespaces per boundary across its groups, more than "
                f"{MAX_NAMESPACES}"
            )
        spans = Spans.of(layout)
        groups = []
        for g, spec in enumerate(layout.groups):
            classes = partitions[g]
            mine = next(c for c in classes if par.tp_rank in c)
            shard = head_shard(spec, par.tp_rank, par.tp_size, heads)
            model_key = layout.group_model_key(g)

            def prefix(s: int, c: int, d: int, p: int, g: int = g, model_key: str = model_key) -> str:
                return namespace_prefix(model_key, layout.cache_prefix, s, c, d, p, g)

            parts: tuple[str, ...] = ()
            replicas: tuple[tuple[int, int], ...] = ()
            if layout.shared(g) and spec.state is not None:
                # Rule 12: shard field = which piece of the state; every piece is a namespace of the quorum.
                pieces = spec.state.pieces(layout.share_tp_size)
                lookup = tuple(prefix(v, 0, 0, p) for v in range(len(pieces)) for p in range(par.pp_size))
                own_pieces = layout.values_of_rank(g, par.tp_rank)
                parts = tuple(prefix(v, 0, 0, par.pp_rank) for v in own_pieces)
                holders = [spec.state.holders(pieces[v], par.tp_size) for v in own_pieces]
                replicas = tuple((len(h), par.tp_rank - h.start) for h in holders)
                own = parts[0]
            elif layout.shared(g) and spec.head_split:
                # Rule 11: shard field = which of the G head groups; no DCP or PCP here (Layout refuses them).
                lookup = tuple(prefix(v, 0, 0, p) for v in range(layout.head_groups) for p in range(par.pp_size))
                parts = tuple(prefix(v, 0, 0, par.pp_rank) for v in layout.values_of_rank(g, par.tp_rank))
                own = parts[0]
            else:
                # One namespace per replication set, on every PCP rank and pipeline stage; a set is named by the
                # heads its ranks hold (tp_rank field) and their DCP rank.
                lookup = tuple(
                    prefix(head_shard(spec, members[0], par.tp_size, heads), c, par.dcp_rank_at(members[0], c), p)
                    for c in range(par.pcp_size)
                    for members in classes
                    for p in range(par.pp_size)
                )
                own = prefix(shard, par.pcp_rank, par.dcp_rank, par.pp_rank)
            s, mid = spans.spans[g], spans.mid[g]
            groups.append(
                GroupGeometry(
                    g,
                    spec,
                    len(mine),
                    s,
                    shard,
                    own,
                    lookup,
                    mine.index(par.tp_rank),
                    mid,
                    parts,
                    layout.shared(g),
                    replicas,
                )
            )
        return cls(layout, tuple(groups), spans.fine_grained, spans.unit)

    def probed_boundaries(self, group: GroupGeometry, num_hashes: int) -> range:
        """Hash indices (boundary // U - 1) whose keys a lookup probes for this group."""
        u = self.layout.hash_block_size
        # Fine-grained hits can end mid-block (tails under any U boundary, recurrent state at any U boundary);
        # otherwise every hit length is a block end of the group.
        step = 1 if group.fine else group.span // u
        return range(step - 1, num_hashes, step)


def _namespaces(layout: Layout, group: int, spec: GroupSpec, classes: int) -> int:
    """Namespaces of one boundary of a group on one PCP rank and stage: one per value where shared, else per class."""
    if layout.shared(group) and spec.state is not None:
        return len(spec.state.pieces(layout.share_tp_size))
    if layout.shared(group) and spec.head_split:
        return layout.head_groups
    return classes
