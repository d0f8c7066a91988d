"""Rules 1, 2, 4, 6, 7 and 9's alignment: per-group facts derived once from a layout."""

from __future__ import annotations

from dataclasses import dataclass

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.keys import namespace_prefix
from kvsidecar_contract.placement.layout import GroupSpec, Layout
from kvsidecar_contract.placement.spans import Spans, span

__all__ = ["MAX_NAMESPACES", "Geometry", "GroupGeometry", "replication_factor", "span", "writes_chunk"]

MAX_NAMESPACES = 1 << 16  # key prefixes a session precomputes, summed over its groups


def replication_factor(group: GroupSpec, tp_size: int, num_kv_heads: int, dcp_size: int) -> int:
    """Rule 1: how many TP ranks hold byte-identical bytes for this group."""
    if dcp_size > 1 or group.recurrent:
        return 1
    if all(k.latent for k in group.members):
        return tp_size
    return max(1, tp_size // num_kv_heads)


def writes_chunk(tp_rank: int, group: int, chunk: int, factor: int) -> bool:
    """Rule 4: inside a replication set exactly one rank writes each chunk; the writer rotates with g."""
    return chunk % factor == (tp_rank + group) % factor


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Derived placement facts of one group, for one rank."""

    index: int
    spec: GroupSpec
    factor: int
    span: int
    shard: int  # this rank's shard id (rule 2)
    prefix: str  # this rank's own namespace
    lookup_prefixes: tuple[str, ...]  # every namespace a boundary must exist in (rule 7)

    @property
    def keys_per_boundary(self) -> int:
        """Rule 7: namespaces that must all hold a boundary before it counts as stored."""
        return len(self.lookup_prefixes)


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
        factors = [replication_factor(spec, par.tp_size, layout.num_kv_heads, par.dcp_size) for spec in layout.groups]
        namespaces = sum(par.pcp_size * (par.tp_size // f) * par.pp_size for f in factors)
        if namespaces > MAX_NAMESPACES:
            raise InvalidLayout(
                f"this layout needs {namespaces} key namespaces per boundary across its groups, more than "
                f"{MAX_NAMESPACES}"
            )
        spans = Spans.of(layout)
        groups = []
        for g, spec in enumerate(layout.groups):
            f = factors[g]
            shard = par.tp_rank // f
            # Shard ids run over T/f; under DCP f = 1 so a shard is a rank and its dcp field is r mod D.
            lookup = tuple(
                namespace_prefix(layout.model_key, layout.cache_prefix, s, c, s % par.dcp_size, p, g)
                for c in range(par.pcp_size)
                for s in range(par.tp_size // f)
                for p in range(par.pp_size)
            )
            own = namespace_prefix(
                layout.model_key, layout.cache_prefix, shard, par.pcp_rank, par.dcp_rank, par.pp_rank, g
            )
            groups.append(GroupGeometry(g, spec, f, spans.spans[g], shard, own, lookup))
        return cls(layout, tuple(groups), spans.fine_grained, spans.unit)

    def probed_boundaries(self, group: GroupGeometry, num_hashes: int) -> range:
        """Hash indices (boundary // U - 1) whose keys a lookup probes for this group."""
        u = self.layout.hash_block_size
        # Fine-grained hits can end mid-block (tails under any U boundary, recurrent state at any U boundary);
        # otherwise every hit length is a block end of every group.
        step = 1 if self.fine_grained else group.span // u
        return range(step - 1, num_hashes, step)
