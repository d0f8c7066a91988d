"""The placement core: pure rules for which rank writes which KV block under which key (docs/placement.md).

No I/O here: ints, bytes and tuples in, frozen values out.
"""

from kvsidecar_contract.limits import NO_BLOCK
from kvsidecar_contract.placement.chunks import (
    Chunk,
    SavePlan,
    check_hit,
    load_plan,
    save_plan,
)
from kvsidecar_contract.placement.errors import InvalidLayout, PlacementError, RequestMismatch
from kvsidecar_contract.placement.geometry import Geometry, GroupGeometry, replication_factor, span, writes_chunk
from kvsidecar_contract.placement.keys import (
    DEFAULT_CHECKSUM_EVERY,
    KEY_TAIL_PATTERN,
    VALUE_FORMAT,
    block_key,
    key_prefix,
    model_key,
    namespace_prefix,
    value_id,
)
from kvsidecar_contract.placement.layout import (
    GroupSpec,
    Kind,
    Layout,
    Parallel,
    check_share_across_tp,
    share_tp_size_of,
)
from kvsidecar_contract.placement.lookup import Hit, LookupPlan, compute_hit, lookup_plan
from kvsidecar_contract.placement.packed import PackedHashes
from kvsidecar_contract.placement.spans import Spans, fine_grained, load_spans, save_spans
from kvsidecar_contract.placement.staged import StagedLookup
from kvsidecar_contract.placement.state import (
    Piece,
    RecurrentState,
    StateAxis,
    StateCut,
    StateSegment,
    StateTensor,
    gated_delta_net_state,
    kda_state,
    mamba2_state,
)
from kvsidecar_contract.placement.syntax import kind_of, parse_group, parse_groups

__all__ = [
    "DEFAULT_CHECKSUM_EVERY",
    "KEY_TAIL_PATTERN",
    "NO_BLOCK",
    "VALUE_FORMAT",
    "Chunk",
    "Geometry",
    "GroupGeometry",
    "GroupSpec",
    "Hit",
    "InvalidLayout",
    "Kind",
    "Layout",
    "LookupPlan",
    "PackedHashes",
    "Parallel",
    "Piece",
    "PlacementError",
    "RecurrentState",
    "RequestMismatch",
    "SavePlan",
    "Spans",
    "StagedLookup",
    "StateAxis",
    "StateCut",
    "StateSegment",
    "StateTensor",
    "block_key",
    "check_hit",
    "check_share_across_tp",
    "compute_hit",
    "fine_grained",
    "gated_delta_net_state",
    "kda_state",
    "key_prefix",
    "kind_of",
    "load_plan",
    "load_spans",
    "lookup_plan",
    "mamba2_state",
    "model_key",
    "namespace_prefix",
    "parse_group",
    "parse_groups",
    "replication_factor",
    "save_plan",
    "save_spans",
    "share_tp_size_of",
    "span",
    "value_id",
    "writes_chunk",
]
