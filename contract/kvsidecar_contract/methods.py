"""The Sidecar service's methods, one row each: everything the daemon's two ways in and the client must agree on.

A row says which messages a call carries, its number on the data socket (`frames`; none: gRPC only), which of the
daemon's pools runs it, whether it first waits for one of its account's lookup slots, and which daemon flag bounds
its request's size. The daemon's gRPC servicer and data socket both read a call through its row into the same plain
handler call, and the client reads its frame numbers and response types here, so adding a method is one row here
plus one handler in the daemon (`kvsidecar.rpc.handlers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["BY_FRAME", "BY_NAME", "METHODS", "Limit", "Method", "Pool"]

# Which of the daemon's pools runs a call's work: "data" (saves, loads, closes: they share the data slots with the
# data socket), "lookup" (lookups and control calls: never queued behind a big save), "loop" (trivial work, answered
# on the event loop).
Pool = Literal["data", "lookup", "loop"]
# What bounds a request's size: --max-message-bytes alone, or --max-lookup-hashes (refused by its size before it
# is parsed: parsing a million hashes holds the GIL).
Limit = Literal["max-message-bytes", "max-lookup-hashes"]


@dataclass(frozen=True)
class Method:
    """One method of kvsidecar.v1.Sidecar."""

    name: str
    request: Any  # the request message class
    response: Any  # the response message class
    pool: Pool
    frame: int | None = None  # its number on the data socket; None: gRPC only
    gate: bool = False  # waits for one of its account's lookup slots (--lookups-per-account) before it runs
    limit: Limit = "max-message-bytes"


METHODS: tuple[Method, ...] = (
    Method("OpenSession", pb.OpenSessionRequest, pb.OpenSessionResponse, "lookup"),
    Method("RegisterMemory", pb.RegisterMemoryRequest, pb.RegisterMemoryResponse, "lookup"),
    Method("KeepAlive", pb.KeepAliveRequest, pb.KeepAliveResponse, "loop"),
    Method("CloseSession", pb.CloseSessionRequest, pb.CloseSessionResponse, "data"),
    Method("Save", pb.SaveRequest, pb.SaveResponse, "data", frame=1),
    Method("SaveBatch", pb.SaveBatchRequest, pb.SaveBatchResponse, "data", frame=2),
    Method("Load", pb.LoadRequest, pb.LoadResponse, "data", frame=3),
    Method("LoadBatch", pb.LoadBatchRequest, pb.LoadBatchResponse, "data", frame=4),
    Method("Lookup", pb.LookupRequest, pb.LookupResponse, "lookup", frame=5, gate=True, limit="max-lookup-hashes"),
    Method("Reset", pb.ResetRequest, pb.ResetResponse, "data"),
    Method("Stats", pb.StatsRequest, pb.StatsResponse, "lookup"),
    Method("DropRetention", pb.DropRetentionRequest, pb.DropRetentionResponse, "data"),
)

BY_NAME: dict[str, Method] = {m.name: m for m in METHODS}
BY_FRAME: dict[int, Method] = {m.frame: m for m in METHODS if m.frame is not None}
