"""Rule 12: a recurrent layer's state as pieces every TP size reads (per head, or group of heads, and per B/C group).

vLLM shards a recurrent layer's state across TP ranks by head, as it shards attention (docs/placement.md rule 12 has
the references into vLLM 0.33). A rank's state is one or more tensors, back to back in its page; each has one
dimension sharded across TP ranks, made of *segments* (a Mamba2 conv state's x, B and C channels), each indexed by
an *axis* (the layer's heads, its B/C groups) and holding the rank's slice of that axis. Every other dimension is
whole on every rank: `outer` elements before the sharded one (the conv window in vLLM's default layout), `inner`
after it.

So the bytes of axis indices [i, j) are the same whatever the TP size, and only their position in a rank's page
depends on it: a *piece* (one axis, a run of its indices) is a value any TP size can write and read, as a list of
byte ranges of one layer's state (`RecurrentState.slices`), always in the same order: tensor, then row of `outer`,
then segment. Pure: ints and tuples in, frozen values out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from kvsidecar_contract.placement.errors import InvalidLayout

__all__ = [
    "MAX_AXES",
    "MAX_AXIS_SIZE",
    "MAX_PIECE_SLICES",
    "MAX_STATE_TENSORS",
    "Piece",
    "RecurrentState",
    "StateAxis",
    "StateCut",
    "StateSegment",
    "StateTensor",
    "gated_delta_net_state",
    "kda_state",
    "mamba2_state",
]

# Far past any real layer, small enough that every table derived from a state stays small.
MAX_AXES = 8
MAX_STATE_TENSORS = 16
MAX_SEGMENTS = 16
MAX_AXIS_SIZE = 1 << 16
MAX_DIM = 1 << 24  # outer, inner and width, in elements
MAX_ITEM_BYTES = 64
MAX_PIECE_SLICES = 4096  # byte ranges of one piece in one layer's state


@dataclass(frozen=True, slots=True)
class StateAxis:
    """An index set a state is sharded over across TP ranks: a layer's heads, its B/C groups.

    A rank of T holds size/T consecutive indices. With repeat, a T above size gives each index to T/size consecutive
    ranks (vLLM's Mamba2 repeats its B/C group to follow the head shards when n_groups is 1). The name is only for
    people: it is not part of what a value means.
    """

    name: str
    size: int
    repeat: bool = False

    def held(self, tp_size: int, tp_rank: int) -> range:
        """The indices TP rank r of T holds, or InvalidLayout if vLLM cannot shard the axis over T ranks."""
        if self.size % tp_size == 0:
            per = self.size // tp_size
            return range(tp_rank * per, (tp_rank + 1) * per)
        if self.repeat and tp_size % self.size == 0:
            index = tp_rank // (tp_size // self.size)
            return range(index, index + 1)
        multiple = " or is a multiple of it (the axis repeats)" if self.repeat else ""
        raise InvalidLayout(
            f"state axis {self.name} of {self.size} cannot be sharded over {tp_size} TP ranks: vLLM needs a TP size "
            f"that divides {self.size}{multiple}"
        )


@dataclass(frozen=True, slots=True)
class StateSegment:
    """A stretch of a tensor's sharded dimension: `width` elements per index of axis `axis`, the rank's indices."""

    axis: int
    width: int


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One state tensor of a layer on a rank: (outer, sharded, inner) elements of item_bytes, C order."""

    item_bytes: int
    outer: int
    segments: tuple[StateSegment, ...]
    inner: int = 1


class Piece(NamedTuple):
    """A value of rule 12: `length` indices of one axis from `first`, across every segment of that axis."""

    axis: int
    first: int
    length: int


class StateCut(NamedTuple):
    """How one rank's block of a shared recurrent group becomes its values (what the daemon maps to addresses).

    The block is one layer's state after another (layer_bytes each, tensors starting at tensor_starts); pieces[p]
    are the byte ranges (offset in one layer's state, size) of the rank's p-th value, in the value's order. Their
    sizes are the same at every TP size (only the offsets move), so they are the value's shape.
    """

    layer_bytes: int
    tensor_starts: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """One recurrent layer's state as the model has it: the axes TP shards it over and its tensors, in page order."""

    axes: tuple[StateAxis, ...]
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.axes) <= MAX_AXES:
            raise InvalidLayout(f"a recurrent state needs 1 to {MAX_AXES} axes, got {len(self.axes)}")
        if not 1 <= len(self.tensors) <= MAX_STATE_TENSORS:
            raise InvalidLayout(f"a recurrent state needs 1 to {MAX_STATE_TENSORS} tensors, got {len(self.tensors)}")
        for axis in self.axes:
            if not 1 <= axis.size <= MAX_AXIS_SIZE:
                raise InvalidLayout(f"state axis {axis.name} must have 1 to {MAX_AXIS_SIZE} indices, got {axis.size}")
        used: set[int] = set()
        for t, tensor in enumerate(self.tensors):
            where = f"state tensor {t}"
            if not 1 <= tensor.item_bytes <= MAX_ITEM_BYTES:
                raise InvalidLayout(f"{where}: item_bytes must be in [1, {MAX_ITEM_BYTES}], got {tensor.item_bytes}")
            if not (1 <= tensor.outer <= MAX_DIM and 1 <= tensor.inner <= MAX_DIM):
                raise InvalidLayout(
                    f"{where}: outer and inner must be in [1, {MAX_DIM}], got {tensor.outer}, {tensor.inner}"
                )
            if not 1 <= len(tensor.segments) <= MAX_SEGMENTS:
                raise InvalidLayout(f"{where}: needs 1 to {MAX_SEGMENTS} segments, got {len(tensor.segments)}")
            for seg in tensor.segments:
                if not 0 <= seg.axis < len(self.axes):
                    raise InvalidLayout(f"{where}: a segment names axis {seg.axis}, the state has {len(self.axes)}")
                if not 1 <= seg.width <= MAX_DIM:
                    raise InvalidLayout(f"{where}: a segment's width must be in [1, {MAX_DIM}], got {seg.width}")
                used.add(seg.axis)
        unused = [a.name for i, a in enumerate(self.axes) if i not in used]
        if unused:
            raise InvalidLayout(f"state axes {unused} shard no segment of any tensor")
        for a in range(len(self.axes)):
            slices = sum(t.outer * sum(s.axis == a for s in t.segments) for t in self.tensors)
            if slices > MAX_PIECE_SLICES:
                raise InvalidLayout(
                    f"a piece of state axis {self.axes[a].name} would be {slices} byte ranges of each layer, more than "
                    f"{MAX_PIECE_SLICES}"
                )

    def check_tp(self, tp_size: int) -> None:
        """Refuse a TP size vLLM cannot shard this state over (every axis must split into whole indices)."""
        for axis in self.axes:
            axis.held(tp_size, 0)

    def tensor_bytes(self, tp_size: int) -> tuple[int, ...]:
        """Bytes of each state tensor of one layer on a rank of TP tp_size (what vLLM's MambaSpec.shapes and dtypes
        give that rank: a connector checks them before it describes a state, so a description that does not match
        the engine's pages is never sent)."""
        held = [len(a.held(tp_size, 0)) for a in self.axes]
        return tuple(
            t.item_bytes * t.outer * t.inner * sum(held[s.axis] * s.width for s in t.segments) for t in self.tensors
        )

    def layer_bytes(self, tp_size: int) -> int:
        """Bytes of one layer's state on a rank of TP tp_size."""
        return sum(self.tensor_bytes(tp_size))

    def pieces(self, share_tp_size: int) -> tuple[Piece, ...]:
        """Rule 12's cut at share_tp_size N: each axis in min(size, N) pieces of equal runs, axis after axis."""
        if share_tp_size < 1:
            raise InvalidLayout(
                f"state is cut in pieces only when shared across TP sizes, got share_tp_size {share_tp_size}"
            )
        out: list[Piece] = []
        for a, axis in enumerate(self.axes):
            parts = min(axis.size, share_tp_size)
            if axis.size % parts:
                raise InvalidLayout(
                    f"share_tp_size {share_tp_size} would cut state axis {axis.name} of {axis.size} into {parts} equal "
                    f"pieces: it must divide {axis.size} (or be at least {axis.size}: one piece per index)"
                )
            count = axis.size // parts
            out += [Piece(a, j * count, count) for j in range(parts)]
        return tuple(out)

    def check_cut(self, share_tp_size: int, tp_size: int) -> None:
        """Refuse a TP size whose ranks would hold part of a piece (as rule 11 refuses part of a value of heads)."""
        self.check_tp(tp_size)
        counts = {p.axis: p.length for p in self.pieces(share_tp_size)}
        for a, axis in enumerate(self.axes):
            held = len(axis.held(tp_size, 0))
            if held % counts[a]:
                raise InvalidLayout(
                    f"share_tp_size {share_tp_size} stores state axis {axis.name} in pieces of {counts[a]}; a "
                    f"TP={tp_size} rank holds {held}, not a whole number of them: every TP size that shares must "
                    f"divide share_tp_size (or use one piece per index: share_tp_size >= {axis.size})"
                )

    def own_pieces(self, share_tp_size: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
        """The pieces (indices into pieces()) TP rank r holds whole, ascending: its value order."""
        out = []
        for i, piece in enumerate(self.pieces(share_tp_size)):
            held = self.axes[piece.axis].held(tp_size, tp_rank)
            if held.start <= piece.first and piece.first + piece.length <= held.stop:
                out.append(i)
        return tuple(out)

    def holders(self, piece: Piece, tp_size: int) -> range:
        """The TP ranks that hold a piece, byte for byte alike: one, or those an axis repeats its index over."""
        axis = self.axes[piece.axis]
        if axis.size % tp_size == 0:
            rank = piece.first // (axis.size // tp_size)
            return range(rank, rank + 1)
        per = tp_size // axis.size
        return range(piece.first * per, (piece.first + 1) * per)

    def slices(self, piece: Piece, tp_size: int, tp_rank: int) -> tuple[tuple[int, int], ...]:
        """(offset, size) of every byte range of a piece in one layer's state on TP rank r: tensor, row, segment."""
        held = [a.held(tp_size, tp_rank) for a in self.axes]
        mine = held[piece.axis]
        if not (mine.start <= piece.first and piece.first + piece.length <= mine.stop):
            raise InvalidLayout(f"TP rank {tp_rank} of {tp_size} does not hold state piece {piece}")
        out: list[tuple[int, int]] = []
        base = 0
        for tensor in self.tensors:
            widths = [len(held[s.axis]) * s.width for s in tensor.segments]
            row = sum(widths)
            starts = list(itertools.accumulate(widths, initial=0))
            unit = tensor.inner * tensor.item_bytes  # bytes of one element of the sharded dimension
            for o in range(tensor.outer):
                for seg, start in zip(tensor.segments, starts, strict=False):
                    if seg.axis == piece.axis:
                        channel = start + (piece.first - mine.start) * seg.width
                        out.append((base + (o * row + channel) * unit, piece.length * seg.width * unit))
            base += tensor.outer * row * unit
        return tuple(out)

    def cut(self, share_tp_size: int, tp_size: int, tp_rank: int) -> StateCut:
        """What the daemon needs to turn a block of this rank into its values (the rank's pieces, in order)."""
        pieces = self.pieces(share_tp_size)
        starts = tuple(itertools.accumulate(self.tensor_bytes(tp_size), initial=0))
        own = self.own_pieces(share_tp_size, tp_size, tp_rank)
        return StateCut(starts[-1], starts[:-1], tuple(self.slices(pieces[i], tp_size, tp_rank) for i in own))

    def piece_bytes(self, piece: Piece) -> int:
        """Bytes of one layer's part of a piece (the same at every TP size)."""
        return sum(
            t.outer * s.width * t.inner * t.item_bytes * piece.length
            for t in self.tensors
            for s in t.segments
            if s.axis == piece.axis
        )

    def label(self, piece: Piece) -> str:
        """A piece for people: `heads 0-7`, `groups 0`."""
        name = self.axes[piece.axis].name
        last = piece.first + piece.length - 1
        return f"{name} {piece.first}" if piece.length == 1 else f"{name} {piece.first}-{last}"

    def describe(self) -> str:
        """The axes, for people and error messages: `heads=64,groups=8`."""
        return ",".join(f"{a.name}={a.size}" for a in self.axes)

    def meaning(self) -> list[object]:
        """What a value's bytes depend on (for the value id): sizes, repeats, tensors; not the axes' names."""
        return [
            [[a.size, a.repeat] for a in self.axes],
            [[t.item_bytes, t.outer, [[s.axis, s.width] for s in t.segments], t.inner] for t in self.tensors],
        ]


# ---- vLLM 0.33's layers (docs/placement.md rule 12 cites the source) ------------------------------------------------


def _conv(item_bytes: int, window: int, segments: tuple[StateSegment, ...], dim_first: bool) -> StateTensor:
    """A conv state: (window, channels) in vLLM's default "SD" layout, (channels, window) with "DS"."""
    if dim_first:
        return StateTensor(item_bytes, 1, segments, window)
    return StateTensor(item_bytes, window, segments, 1)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise InvalidLayout(f"{name} must be >= 1, got {value}")


def mamba2_state(
    *,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    conv_kernel: int,
    conv_bytes: int,
    ssm_bytes: int,
    intermediate_size: int = 0,
    num_spec: int = 0,
    conv_dim_first: bool = False,
) -> RecurrentState:
    """A Mamba2 layer: the conv state over [x | B | C] channels, then the temporal state (heads, head_dim, state).

    x holds intermediate_size / num_heads channels per head (num_heads * head_dim by default), B and C state_size
    per group; vLLM repeats the one group on every rank when n_groups is 1 and refuses any other n_groups that T
    does not divide.
    """
    _positive(num_heads=num_heads, head_dim=head_dim, n_groups=n_groups, state_size=state_size, conv_kernel=conv_kernel)
    inter = intermediate_size or num_heads * head_dim
    if inter % num_heads:
        raise InvalidLayout(f"intermediate_size {inter} is not whole heads of {num_heads}: its channels map to no head")
    heads, groups = StateAxis("heads", num_heads), StateAxis("groups", n_groups, repeat=n_groups == 1)
    window = conv_kernel - 1 + num_spec
    _positive(conv_window=window)
    conv = (StateSegment(0, inter // num_heads), StateSegment(1, state_size), StateSegment(1, state_size))
    temporal = StateTensor(ssm_bytes, 1, (StateSegment(0, 1),), head_dim * state_size)
    return RecurrentState((heads, groups), (_conv(conv_bytes, window, conv, conv_dim_first), temporal))


def gated_delta_net_state(
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    conv_bytes: int,
    ssm_bytes: int,
    num_spec: int = 0,
    conv_dim_first: bool = False,
) -> RecurrentState:
    """A gated-delta-net layer (Qwen3-Next, Qwen3.5): the conv state over [q | k | v], then (v_heads, v_dim, k_dim)."""
    _positive(
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        conv_kernel=conv_kernel,
    )  # fmt: skip
    window = conv_kernel - 1 + num_spec
    _positive(conv_window=window)
    axes = (StateAxis("v_heads", num_v_heads), StateAxis("k_heads", num_k_heads))
    conv = (StateSegment(1, head_k_dim), StateSegment(1, head_k_dim), StateSegment(0, head_v_dim))
    temporal = StateTensor(ssm_bytes, 1, (StateSegment(0, 1),), head_v_dim * head_k_dim)
    return RecurrentState(axes, (_conv(conv_bytes, window, conv, conv_dim_first), temporal))


def kda_state(
    *,
    num_heads: int,
    head_dim: int,
    conv_kernel: int,
    conv_bytes: int,
    ssm_bytes: int,
    num_spec: int = 0,
    conv_dim_first: bool = False,
) -> RecurrentState:
    """A Kimi delta attention layer (Kimi-Linear): the conv state over [q | k | v], then (heads, head_dim, head_dim)."""
    _positive(num_heads=num_heads, head_dim=head_dim, conv_kernel=conv_kernel)
    window = conv_kernel - 1 + num_spec
    _positive(conv_window=window)
    conv = (StateSegment(0, head_dim),) * 3
    temporal = StateTensor(ssm_bytes, 1, (StateSegment(0, 1),), head_dim * head_dim)
    return RecurrentState((StateAxis("heads", num_heads),), (_conv(conv_bytes, window, conv, conv_dim_first), temporal))
