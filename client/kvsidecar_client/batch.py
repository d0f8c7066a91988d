"""Batched saves and loads: the items an engine step sends in one SaveBatch or LoadBatch call, and their answers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc

from kvsidecar_client.errors import DaemonError, InvalidRequest, SidecarError, error_for_status
from kvsidecar_client.results import Hit, LoadResult, SaveResult
from kvsidecar_client.retention import Retention
from kvsidecar_contract.limits import MAX_BATCH_ITEMS, MAX_BLOCK_IDS, MAX_HASHES
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = [
    "LoadItem",
    "SaveItem",
    "chunks",
    "item_outcomes",
    "load_batch_request",
    "load_requests",
    "retention_message",
    "save_batch_request",
    "save_requests",
]

T = TypeVar("T")

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SaveItem(NamedTuple):
    """One request's save inside a batch; `name` (e.g. vLLM's request id) names its result."""

    name: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    num_tokens: int
    saved_tokens: int = 0
    token_ids: Sequence[int] = ()  # optional: the request's tokens from token_ids_start on, for KV events
    token_ids_start: int = 0
    retention: Retention | None = None  # None: the client's default (docs/retention.md)


class LoadItem(NamedTuple):
    """One request's load inside a batch; `name` names its result."""

    name: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    hit: Hit
    start_tokens: int = 0
    retention: Retention | None = None  # a hit retains what it read; None: the client's default


BlockIdsOf = Callable[[Sequence[Sequence[int]]], list[pb.BlockIds]]


def save_requests(
    items: Sequence[SaveItem], block_ids: BlockIdsOf, retention: Retention | None = None
) -> dict[str, pb.SaveRequest | InvalidRequest]:
    """Each item's SaveRequest (retention: the default of items without one), or why the client refuses it."""
    out: dict[str, pb.SaveRequest | InvalidRequest] = {}
    for item in items:
        try:
            out[item.name] = pb.SaveRequest(
                block_hashes=item.block_hashes,
                block_ids=block_ids(item.block_ids),
                num_tokens=item.num_tokens,
                saved_tokens=item.saved_tokens,
                token_ids=item.token_ids,
                token_ids_start=item.token_ids_start,
                retention=retention_message(item.retention or retention),
            )
        except InvalidRequest as error:
            out[item.name] = error
        except (TypeError, ValueError) as error:
            out[item.name] = InvalidRequest(f"bad SaveBatch item {item.name!r}: {error}", method="SaveBatch")
    return out


def load_requests(
    items: Sequence[LoadItem], block_ids: BlockIdsOf, retention: Retention | None = None
) -> dict[str, pb.LoadRequest | LoadResult | InvalidRequest]:
    """Each item's LoadRequest (retention: the default of items without one), an empty result for a miss (nothing
    to read), or why the client refuses it."""
    out: dict[str, pb.LoadRequest | LoadResult | InvalidRequest] = {}
    for item in items:
        try:
            ids = block_ids(item.block_ids)
            if item.hit.hit_tokens == 0:
                out[item.name] = LoadResult(0, 0, ())
                continue
            out[item.name] = pb.LoadRequest(
                block_hashes=item.block_hashes,
                block_ids=ids,
                hit_tokens=item.hit.hit_tokens,
                tail_boundaries=item.hit.tail_boundaries,
                start_tokens=item.start_tokens,
                retention=retention_message(item.retention or retention),
            )
        except InvalidRequest as error:
            out[item.name] = error
        except (TypeError, ValueError) as error:
            out[item.name] = InvalidRequest(f"bad LoadBatch item {item.name!r}: {error}", method="LoadBatch")
    return out


def retention_message(retention: Retention | None) -> pb.Retention | None:
    """A request's Retention field (None: unset, the values are ordinary cache)."""
    return None if retention is None else retention.to_proto()


def chunks(items: Sequence[tuple[str, Any, T]]) -> Iterator[list[tuple[str, Any, T]]]:
    """(name, request, extra) items cut into batches the daemon accepts (items, hashes and block ids together)."""
    batch: list[tuple[str, Any, T]] = []
    hashes = ids = 0
    for item in items:
        request = item[1]
        h = len(request.block_hashes)
        n = sum(len(g.ids) for g in request.block_ids)
        if batch and (len(batch) == MAX_BATCH_ITEMS or hashes + h > MAX_HASHES or ids + n > MAX_BLOCK_IDS):
            yield batch
            batch, hashes, ids = [], 0, 0
        batch.append(item)
        hashes += h
        ids += n
    if batch:
        yield batch


def item_outcomes(
    method: str, names: Sequence[str], results: Sequence[Any], cls: type[SaveResult] | type[LoadResult]
) -> list[SaveResult | LoadResult | SidecarError]:
    """Each item's result or its own error, in the items' order, checked against the names the batch sent."""
    if [r.name for r in results] != list(names):
        # A daemon that answers other names than asked cannot be trusted with any of them.
        error = DaemonError(f"the daemon answered {len(results)} results for {len(names)} items, named otherwise")
        return [error] * len(names)
    out: list[SaveResult | LoadResult | SidecarError] = []
    for result in results:
        if result.WhichOneof("outcome") == "error":
            code = _CODES.get(result.error.code, grpc.StatusCode.UNKNOWN)
            out.append(error_for_status(code, result.error.reason, method))
        else:
            out.append(cls.from_proto(result.response))
    return out


def save_batch_request(items: Sequence[tuple[str, pb.SaveRequest, Any]]) -> pb.SaveBatchRequest:
    """A SaveBatch of (name, request, _) items."""
    return pb.SaveBatchRequest(items=[pb.SaveItem(name=name, request=request) for name, request, _ in items])


def load_batch_request(items: Sequence[tuple[str, pb.LoadRequest, Any]]) -> pb.LoadBatchRequest:
    """A LoadBatch of (name, request, _) items."""
    return pb.LoadBatchRequest(items=[pb.LoadItem(name=name, request=request) for name, request, _ in items])
