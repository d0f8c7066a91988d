from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_RANK: _ClassVar[Role]
    ROLE_SCHEDULER: _ClassVar[Role]

class GroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_KIND_UNSPECIFIED: _ClassVar[GroupKind]
    FULL_ATTENTION: _ClassVar[GroupKind]
    SLIDING_WINDOW: _ClassVar[GroupKind]
    MLA: _ClassVar[GroupKind]
    SLIDING_WINDOW_MLA: _ClassVar[GroupKind]
    MAMBA: _ClassVar[GroupKind]
    UNIFORM: _ClassVar[GroupKind]
ROLE_UNSPECIFIED: Role
ROLE_RANK: Role
ROLE_SCHEDULER: Role
GROUP_KIND_UNSPECIFIED: GroupKind
FULL_ATTENTION: GroupKind
SLIDING_WINDOW: GroupKind
MLA: GroupKind
SLIDING_WINDOW_MLA: GroupKind
MAMBA: GroupKind
UNIFORM: GroupKind

class EngineIdentity(_message.Message):
    __slots__ = ("model", "cache_prefix", "value_identity")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    VALUE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    cache_prefix: str
    value_identity: str
    def __init__(self, model: _Optional[str] = ..., cache_prefix: _Optional[str] = ..., value_identity: _Optional[str] = ...) -> None: ...

class ParallelLayout(_message.Message):
    __slots__ = ("tp_size", "tp_rank", "pp_size", "pp_rank", "pcp_size", "pcp_rank", "dcp_size", "dcp_rank")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PCP_RANK_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_RANK_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    pcp_size: int
    pcp_rank: int
    dcp_size: int
    dcp_rank: int
    def __init__(self, tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pcp_size: _Optional[int] = ..., pcp_rank: _Optional[int] = ..., dcp_size: _Optional[int] = ..., dcp_rank: _Optional[int] = ...) -> None: ...

class RecurrentState(_message.Message):
    __slots__ = ("axes", "tensors")
    AXES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    axes: _containers.RepeatedCompositeFieldContainer[StateAxis]
    tensors: _containers.RepeatedCompositeFieldContainer[StateTensor]
    def __init__(self, axes: _Optional[_Iterable[_Union[StateAxis, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[StateTensor, _Mapping]]] = ...) -> None: ...

class StateAxis(_message.Message):
    __slots__ = ("name", "size", "repeat")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    repeat: bool
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., repeat: _Optional[bool] = ...) -> None: ...

class StateTensor(_message.Message):
    __slots__ = ("item_bytes", "outer", "segments", "inner")
    ITEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    INNER_FIELD_NUMBER: _ClassVar[int]
    item_bytes: int
    outer: int
    segments: _containers.RepeatedCompositeFieldContainer[StateSegment]
    inner: int
    def __init__(self, item_bytes: _Optional[int] = ..., outer: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[StateSegment, _Mapping]]] = ..., inner: _Optional[int] = ...) -> None: ...

class StateSegment(_message.Message):
    __slots__ = ("axis", "width")
    AXIS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    axis: int
    width: int
    def __init__(self, axis: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("kind", "block_size", "window", "inner", "state")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    INNER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    kind: GroupKind
    block_size: int
    window: int
    inner: _containers.RepeatedScalarFieldContainer[GroupKind]
    state: RecurrentState
    def __init__(self, kind: _Optional[_Union[GroupKind, str]] = ..., block_size: _Optional[int] = ..., window: _Optional[int] = ..., inner: _Optional[_Iterable[_Union[GroupKind, str]]] = ..., state: _Optional[_Union[RecurrentState, _Mapping]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("engine", "parallel", "num_kv_heads", "hash_block_size", "groups", "hash_bytes", "role", "client_name", "hit_alignment_tokens", "fine_grained_hits", "share_tp_size")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HASH_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HIT_ALIGNMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINE_GRAINED_HITS_FIELD_NUMBER: _ClassVar[int]
    SHARE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine: EngineIdentity
    parallel: ParallelLayout
    num_kv_heads: int
    hash_block_size: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    hash_bytes: int
    role: Role
    client_name: str
    hit_alignment_tokens: int
    fine_grained_hits: bool
    share_tp_size: int
    def __init__(self, engine: _Optional[_Union[EngineIdentity, _Mapping]] = ..., parallel: _Optional[_Union[ParallelLayout, _Mapping]] = ..., num_kv_heads: _Optional[int] = ..., hash_block_size: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., hash_bytes: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., client_name: _Optional[str] = ..., hit_alignment_tokens: _Optional[int] = ..., fine_grained_hits: _Optional[bool] = ..., share_tp_size: _Optional[int] = ...) -> None: ...

class GroupPlacement(_message.Message):
    __slots__ = ("replication_factor", "shard_id", "keys_per_boundary", "span_tokens", "shared_across_tp", "values_per_block")
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_PER_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SPAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_ACROSS_TP_FIELD_NUMBER: _ClassVar[int]
    VALUES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    replication_factor: int
    shard_id: int
    keys_per_boundary: int
    span_tokens: int
    shared_across_tp: bool
    values_per_block: int
    def __init__(self, replication_factor: _Optional[int] = ..., shard_id: _Optional[int] = ..., keys_per_boundary: _Optional[int] = ..., span_tokens: _Optional[int] = ..., shared_across_tp: _Optional[bool] = ..., values_per_block: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_ms", "hit_alignment_tokens", "fine_grained_hits", "groups", "daemon_version", "side_secret", "tenant", "packed_hashes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    HIT_ALIGNMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINE_GRAINED_HITS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIDE_SECRET_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ms: int
    hit_alignment_tokens: int
    fine_grained_hits: bool
    groups: _containers.RepeatedCompositeFieldContainer[GroupPlacement]
    daemon_version: str
    side_secret: bytes
    tenant: str
    packed_hashes: bool
    def __init__(self, session_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., hit_alignment_tokens: _Optional[int] = ..., fine_grained_hits: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[GroupPlacement, _Mapping]]] = ..., daemon_version: _Optional[str] = ..., side_secret: _Optional[bytes] = ..., tenant: _Optional[str] = ..., packed_hashes: _Optional[bool] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class MemfdHandle(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: int
    def __init__(self, index: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("shm", "cuda", "memfd", "mapping_bytes", "offset", "block_stride", "block_bytes", "num_blocks", "groups", "heads")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    MEMFD_FIELD_NUMBER: _ClassVar[int]
    MAPPING_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemoryHandle
    cuda: CudaIpcHandle
    memfd: MemfdHandle
    mapping_bytes: int
    offset: int
    block_stride: int
    block_bytes: int
    num_blocks: int
    groups: _containers.RepeatedScalarFieldContainer[int]
    heads: int
    def __init__(self, shm: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., memfd: _Optional[_Union[MemfdHandle, _Mapping]] = ..., mapping_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., block_stride: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[int]] = ..., heads: _Optional[int] = ...) -> None: ...

class RegisterMemoryRequest(_message.Message):
    __slots__ = ("session_id", "regions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    def __init__(self, session_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ...) -> None: ...

class RegisterMemoryResponse(_message.Message):
    __slots__ = ("mapped_bytes", "value_bytes")
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    mapped_bytes: int
    value_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mapped_bytes: _Optional[int] = ..., value_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ms", "store_healthy")
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    store_healthy: bool
    def __init__(self, lease_ms: _Optional[int] = ..., store_healthy: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FailedBlock(_message.Message):
    __slots__ = ("group", "block_id", "reason")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group: int
    block_id: int
    reason: str
    def __init__(self, group: _Optional[int] = ..., block_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("session_id", "block_hashes", "block_ids", "num_tokens", "saved_tokens", "token_ids", "token_ids_start", "retention")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_START_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    saved_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids_start: int
    retention: Retention
    def __init__(self, session_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., saved_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_ids_start: _Optional[int] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("seconds", "priority", "renew", "end_tokens", "hard")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    END_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HARD_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    priority: int
    renew: bool
    end_tokens: int
    hard: bool
    def __init__(self, seconds: _Optional[float] = ..., priority: _Optional[int] = ..., renew: _Optional[bool] = ..., end_tokens: _Optional[int] = ..., hard: _Optional[bool] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("written", "skipped", "failed", "striped_to_others", "bytes_written", "failures", "absent", "retained", "unretained")
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STRIPED_TO_OTHERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    UNRETAINED_FIELD_NUMBER: _ClassVar[int]
    written: int
    skipped: int
    failed: int
    striped_to_others: int
    bytes_written: int
    failures: _containers.RepeatedCompositeFieldContainer[FailedBlock]
    absent: int
    retained: int
    unretained: int
    def __init__(self, written: _Optional[int] = ..., skipped: _Optional[int] = ..., failed: _Optional[int] = ..., striped_to_others: _Optional[int] = ..., bytes_written: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[FailedBlock, _Mapping]]] = ..., absent: _Optional[int] = ..., retained: _Optional[int] = ..., unretained: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "block_hashes", "num_tokens", "eagle", "packed_block_hashes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EAGLE_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    eagle: bool
    packed_block_hashes: bytes
    def __init__(self, session_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., eagle: _Optional[bool] = ..., packed_block_hashes: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_tokens", "tail_boundaries", "degraded", "detail")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    tail_boundaries: _containers.RepeatedScalarFieldContainer[int]
    degraded: bool
    detail: str
    def __init__(self, hit_tokens: _Optional[int] = ..., tail_boundaries: _Optional[_Iterable[int]] = ..., degraded: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("session_id", "block_hashes", "block_ids", "hit_tokens", "tail_boundaries", "start_tokens", "retention", "carried_groups")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    START_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    CARRIED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    hit_tokens: int
    tail_boundaries: _containers.RepeatedScalarFieldContainer[int]
    start_tokens: int
    retention: Retention
    carried_groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., hit_tokens: _Optional[int] = ..., tail_boundaries: _Optional[_Iterable[int]] = ..., start_tokens: _Optional[int] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., carried_groups: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("loaded", "bytes_loaded", "failures", "retained", "unretained")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    UNRETAINED_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    bytes_loaded: int
    failures: _containers.RepeatedCompositeFieldContainer[FailedBlock]
    retained: int
    unretained: int
    def __init__(self, loaded: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[FailedBlock, _Mapping]]] = ..., retained: _Optional[int] = ..., unretained: _Optional[int] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SaveItem(_message.Message):
    __slots__ = ("name", "request")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    request: SaveRequest
    def __init__(self, name: _Optional[str] = ..., request: _Optional[_Union[SaveRequest, _Mapping]] = ...) -> None: ...

class SaveBatchRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[SaveItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[SaveItem, _Mapping]]] = ...) -> None: ...

class SaveItemResult(_message.Message):
    __slots__ = ("name", "response", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    response: SaveResponse
    error: ItemError
    def __init__(self, name: _Optional[str] = ..., response: _Optional[_Union[SaveResponse, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class SaveBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SaveItemResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SaveItemResult, _Mapping]]] = ...) -> None: ...

class LoadItem(_message.Message):
    __slots__ = ("name", "request")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    request: LoadRequest
    def __init__(self, name: _Optional[str] = ..., request: _Optional[_Union[LoadRequest, _Mapping]] = ...) -> None: ...

class LoadBatchRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[LoadItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[LoadItem, _Mapping]]] = ...) -> None: ...

class LoadItemResult(_message.Message):
    __slots__ = ("name", "response", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    response: LoadResponse
    error: ItemError
    def __init__(self, name: _Optional[str] = ..., response: _Optional[_Union[LoadResponse, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class LoadBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LoadItemResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LoadItemResult, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id_prefix", "role", "model", "cache_prefix", "parallel", "mapped_bytes", "age_seconds", "client_name", "tenant", "data_connections")
    SESSION_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    session_id_prefix: str
    role: Role
    model: str
    cache_prefix: str
    parallel: ParallelLayout
    mapped_bytes: int
    age_seconds: float
    client_name: str
    tenant: str
    data_connections: int
    def __init__(self, session_id_prefix: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., model: _Optional[str] = ..., cache_prefix: _Optional[str] = ..., parallel: _Optional[_Union[ParallelLayout, _Mapping]] = ..., mapped_bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., client_name: _Optional[str] = ..., tenant: _Optional[str] = ..., data_connections: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("daemon_version", "uptime_seconds", "store_healthy", "store_detail", "master_address", "sessions", "counters", "listeners", "tenancy", "caller_tenant", "gpu", "gpu_failure", "retention")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STORE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LISTENERS_FIELD_NUMBER: _ClassVar[int]
    TENANCY_FIELD_NUMBER: _ClassVar[int]
    CALLER_TENANT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    daemon_version: str
    uptime_seconds: float
    store_healthy: bool
    store_detail: str
    master_address: str
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    counters: _containers.ScalarMap[str, float]
    listeners: _containers.RepeatedCompositeFieldContainer[ListenerInfo]
    tenancy: str
    caller_tenant: str
    gpu: str
    gpu_failure: str
    retention: _containers.RepeatedCompositeFieldContainer[RetentionUsage]
    def __init__(self, daemon_version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., store_healthy: _Optional[bool] = ..., store_detail: _Optional[str] = ..., master_address: _Optional[str] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., listeners: _Optional[_Iterable[_Union[ListenerInfo, _Mapping]]] = ..., tenancy: _Optional[str] = ..., caller_tenant: _Optional[str] = ..., gpu: _Optional[str] = ..., gpu_failure: _Optional[str] = ..., retention: _Optional[_Iterable[_Union[RetentionUsage, _Mapping]]] = ...) -> None: ...

class RetentionUsage(_message.Message):
    __slots__ = ("tenant", "retained_bytes", "budget_bytes", "hard_pinned_bytes", "values")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HARD_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    retained_bytes: int
    budget_bytes: int
    hard_pinned_bytes: int
    values: int
    def __init__(self, tenant: _Optional[str] = ..., retained_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., hard_pinned_bytes: _Optional[int] = ..., values: _Optional[int] = ...) -> None: ...

class DropRetentionRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class DropRetentionResponse(_message.Message):
    __slots__ = ("values", "bytes", "failed")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    values: int
    bytes: int
    failed: int
    def __init__(self, values: _Optional[int] = ..., bytes: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class ListenerInfo(_message.Message):
    __slots__ = ("role", "address", "allowed", "dropped_packets")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PACKETS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    allowed: str
    dropped_packets: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., allowed: _Optional[str] = ..., dropped_packets: _Optional[int] = ...) -> None: ...
