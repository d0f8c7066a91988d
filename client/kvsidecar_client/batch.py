"""Batched saves and loads: the items an engine step sends in SaveBatch or LoadBatch calls, as one `Batch` (the
contract's shape: each item answered with its result or its own error), and the calls that answer them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc

from kvsidecar_client.errors import DaemonError, InvalidRequest, SidecarError, error_for_status
from kvsidecar_client.results import Hit, LoadResult, SaveResult
from kvsidecar_client.retention import Retention
from kvsidecar_client.session import SessionKeeper, remaining
from kvsidecar_contract.batches import Batch
from kvsidecar_contract.limits import MAX_BATCH_ITEMS, MAX_BLOCK_IDS, MAX_HASHES
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = [
    "LoadItem",
    "SaveItem",
    "item_outcomes",
    "load_items",
    "parts",
    "retention_message",
    "save_items",
    "send",
]

T = TypeVar("T")
R = TypeVar("R", SaveResult, LoadResult)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# What one SaveBatch or LoadBatch may carry: items, and their hashes and block ids all together.
_LIMITS = (MAX_BATCH_ITEMS, MAX_HASHES, MAX_BLOCK_IDS)
_REQUESTS: dict[str, Any] = {"SaveBatch": pb.SaveBatchRequest, "LoadBatch": pb.LoadBatchRequest}


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
    groups: Sequence[int] = ()  # the KV-cache groups the load is for (empty: every group; see load_detailed)


BlockIdsOf = Callable[[Sequence[Sequence[int]]], list[pb.BlockIds]]


def save_items(
    items: Sequence[SaveItem], block_ids: BlockIdsOf, retention: Retention | None = None
) -> Batch[pb.SaveItem, SaveResult]:
    """The items as one batch: each one's SaveItem message (retention: the default of items without one), or why
    the client refuses it, that item alone."""

    def message(item: SaveItem) -> pb.SaveItem:
        request = _built(
            "SaveBatch",
            item.name,
            lambda: pb.SaveRequest(
                block_hashes=item.block_hashes,
                block_ids=block_ids(item.block_ids),
                num_tokens=item.num_tokens,
                saved_tokens=item.saved_tokens,
                token_ids=item.token_ids,
                token_ids_start=item.token_ids_start,
                retention=retention_message(item.retention or retention),
            ),
        )
        return pb.SaveItem(name=item.name, request=request)

    return Batch(items).step(message)


def load_items(
    items: Sequence[LoadItem], block_ids: BlockIdsOf, retention: Retention | None = None
) -> Batch[pb.LoadItem, LoadResult]:
    """The items as one batch: each one's LoadItem message (retention: the default of items without one), or why
    the client refuses it; a miss is answered at once with an empty result (nothing to read)."""

    def message(item: LoadItem) -> pb.LoadItem:
        request = _built(
            "LoadBatch",
            item.name,
            lambda: pb.LoadRequest(
                block_hashes=item.block_hashes,
                block_ids=block_ids(item.block_ids),
                hit_tokens=item.hit.hit_tokens,
                tail_boundaries=item.hit.tail_boundaries,
                start_tokens=item.start_tokens,
                retention=retention_message(item.retention or retention),
                carried_groups=item.groups,
            ),
        )
        return pb.LoadItem(name=item.name, request=request)

    batch: Batch[pb.LoadItem, LoadResult] = Batch(items).step(message)
    batch.settle(lambda item: LoadResult(0, 0, ()) if item.request.hit_tokens == 0 else None)
    return batch


def retention_message(retention: Retention | None) -> pb.Retention | None:
    """A request's Retention field (None: unset, the values are ordinary cache)."""
    return None if retention is None else retention.to_proto()


def parts(batch: Batch[Any, R]) -> list[Batch[Any, R]]:
    """The batch's open items cut, in order, into calls the daemon accepts (items, hashes and block ids together)."""
    return batch.parts(_cost, _LIMITS)


def send(keeper: SessionKeeper, method: str, part: Batch[Any, R], result: type[R], deadline: float) -> None:
    """One SaveBatch or LoadBatch call of the part's open items: each answered with its result or its own error, or
    every one with the error of a call that failed whole (a lost session is re-opened and the call sent again once).
    """
    items = part.open()
    try:
        response = keeper.call(method, _REQUESTS[method](items=items), remaining(deadline, method))
        part.answer(item_outcomes(method, [item.name for item in items], response.results, result))
    except Exception as error:
        # Every item is answered: an engine waits on a save's job before it reuses the blocks.
        part.fail(error)


def item_outcomes(method: str, names: Sequence[str], results: Sequence[Any], cls: type[R]) -> list[R | SidecarError]:
    """Each item's result or its own error, in the items' order, checked against the names the batch sent."""
    if [r.name for r in results] != list(names):
        # A daemon that answers other names than asked cannot be trusted with any of them.
        error = DaemonError(f"the daemon answered {len(results)} results for {len(names)} items, named otherwise")
        return [error for _ in names]
    out: list[R | SidecarError] = []
    for result in results:
        if result.WhichOneof("outcome") == "error":
            code = _CODES.get(result.error.code, grpc.StatusCode.UNKNOWN)
            out.append(error_for_status(code, result.error.reason, method))
        else:
            out.append(cls.from_proto(result.response))
    return out


def _built(method: str, name: str, build: Callable[[], T]) -> T:
    # protobuf raises TypeError/ValueError for a str hash or a negative count: the item's own InvalidRequest.
    try:
        return build()
    except (TypeError, ValueError) as error:
        if isinstance(error, InvalidRequest):
            raise
        raise InvalidRequest(f"bad {method} item {name!r}: {error}", method=method) from None


def _cost(item: Any) -> tuple[int, int, int]:
    request = item.request
    return 1, len(request.block_hashes), sum(len(g.ids) for g in request.block_ids)
