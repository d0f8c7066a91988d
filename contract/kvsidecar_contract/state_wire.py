"""A recurrent layer's state layout (placement rule 12) on the wire: the core's RecurrentState and the contract's
RecurrentState message, both ways, in the one copy the daemon and the client use.

The message carries every field as given; what a state may be is the core's rule alone (RecurrentState's
validation, then the layout's cut at OpenSession), so a message the core refuses is refused with the core's reason.
"""

from __future__ import annotations

from kvsidecar_contract.placement.errors import InvalidLayout
from kvsidecar_contract.placement.state import (
    MAX_AXES,
    MAX_SEGMENTS,
    MAX_STATE_TENSORS,
    RecurrentState,
    StateAxis,
    StateSegment,
    StateTensor,
)
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["state_from_message", "state_to_message"]


def state_to_message(state: RecurrentState) -> pb.RecurrentState:
    """The RecurrentState message of a state layout."""
    return pb.RecurrentState(
        axes=[pb.StateAxis(name=a.name, size=a.size, repeat=a.repeat) for a in state.axes],
        tensors=[
            pb.StateTensor(
                item_bytes=t.item_bytes,
                outer=t.outer,
                segments=[pb.StateSegment(axis=s.axis, width=s.width) for s in t.segments],
                inner=t.inner,
            )
            for t in state.tensors
        ],
    )


def state_from_message(message: pb.RecurrentState) -> RecurrentState:
    """The state layout a message describes, validated by the core; InvalidLayout with the reason if it is none.

    Counts are checked before anything is built, so an oversized message costs nothing beyond its parsing.
    """
    if len(message.axes) > MAX_AXES or len(message.tensors) > MAX_STATE_TENSORS:
        raise InvalidLayout(
            f"a recurrent state has at most {MAX_AXES} axes and {MAX_STATE_TENSORS} tensors, got "
            f"{len(message.axes)} and {len(message.tensors)}"
        )
    if any(len(t.segments) > MAX_SEGMENTS for t in message.tensors):
        raise InvalidLayout(f"a state tensor has at most {MAX_SEGMENTS} segments")
    axes = tuple(StateAxis(a.name, a.size, a.repeat) for a in message.axes)
    tensors = tuple(
        StateTensor(t.item_bytes, t.outer, tuple(StateSegment(s.axis, s.width) for s in t.segments), t.inner)
        for t in message.tensors
    )
    return RecurrentState(axes, tensors)
