"""Thin in-engine client for the kvsidecar daemon.

Usage:

    layout = EngineLayout(tp_size=2, tp_rank=0)
    client = SidecarClient.connect("unix:///run/kvsidecar/kvsidecar.sock", model="org/Model", layout=layout,
                                   num_kv_heads=1, hash_block_size=16, groups=[GroupSpec("mla", block_size=16)])
    kv = shared_tensor((num_blocks, 16, 576), torch.bfloat16)
    client.register([kv], groups_of_tensor=[(0,)])
    job = client.save(block_hashes, block_ids, num_tokens)   # job.result() -> SaveResult
    hit = client.lookup(block_hashes, num_tokens)             # Hit(hit_tokens, tail_boundaries, ...)
    failed = client.load(block_hashes, block_ids, hit)        # ids of blocks to recompute
    client.close()
"""

from kvsidecar_client._channel import TcpAuth
from kvsidecar_client.batch import LoadItem, SaveItem
from kvsidecar_client.client import SidecarClient
from kvsidecar_client.deadlines import Deadlines
from kvsidecar_client.errors import (
    ClientClosed,
    DaemonError,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidRequest,
    PermissionDenied,
    PreconditionFailed,
    ResourceExhausted,
    SessionLost,
    SharedMemoryFull,
    SidecarError,
    Unsupported,
)
from kvsidecar_client.jobs import SaveJob
from kvsidecar_client.layout import EngineLayout, GroupSpec, SessionSpec
from kvsidecar_client.memory import shared_tensor
from kvsidecar_client.probe import DaemonProbe
from kvsidecar_client.results import (
    FailedBlock,
    GroupPlacement,
    Hit,
    LoadResult,
    Registration,
    SaveResult,
    SessionInfo,
)
from kvsidecar_client.retention import Retention
from kvsidecar_contract.limits import NO_BLOCK

__version__ = "0.1.0"

__all__ = [
    "ClientClosed",
    "DaemonError",
    "DaemonProbe",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "Deadlines",
    "EngineLayout",
    "FailedBlock",
    "GroupPlacement",
    "GroupSpec",
    "Hit",
    "InvalidRequest",
    "LoadItem",
    "LoadResult",
    "NO_BLOCK",
    "PermissionDenied",
    "PreconditionFailed",
    "Registration",
    "ResourceExhausted",
    "Retention",
    "SaveItem",
    "SaveJob",
    "SaveResult",
    "SessionInfo",
    "SessionLost",
    "SessionSpec",
    "SharedMemoryFull",
    "SidecarClient",
    "SidecarError",
    "TcpAuth",
    "Unsupported",
    "shared_tensor",
]
