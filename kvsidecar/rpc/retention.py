"""Retention on the wire: a request's Retention message to its values (checked, with the reason), and what Stats and
DropRetention answer about it (docs/retention.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from kvsidecar.datapath.retention import Dropped
from kvsidecar.errors import BadRequest
from kvsidecar.tenancy.retention import Usage
from kvsidecar.values import RetentionArgs
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["MAX_PRIORITY", "drop_response", "retention_args", "usage_messages"]

MAX_PRIORITY = 100


def retention_args(request: pb.SaveRequest | pb.LoadRequest) -> RetentionArgs | None:
    """The request's retention, or None when it asked for none."""
    if not request.HasField("retention"):
        return None
    r = request.retention
    priority = r.priority if r.HasField("priority") else MAX_PRIORITY
    if priority > MAX_PRIORITY:
        raise BadRequest(f"retention.priority is 0-{MAX_PRIORITY} (vLLM's retention priorities), got {priority}")
    if not r.hard and not (math.isfinite(r.seconds) and r.seconds > 0):
        raise BadRequest(f"retention.seconds must be a number of seconds > 0 (how long to keep), got {r.seconds}")
    return RetentionArgs(r.seconds, priority, r.renew, r.end_tokens, r.hard)


def usage_messages(
    tenants: Iterable[str], usage: Mapping[str, Usage], budget_of: Callable[[str], int]
) -> list[pb.RetentionUsage]:
    """These tenants' retention now, with their budgets, as Stats shows it."""
    out = []
    for tenant in sorted(tenants):
        u = usage.get(tenant, Usage())
        out.append(
            pb.RetentionUsage(
                tenant=tenant,
                retained_bytes=u.retained_bytes,
                budget_bytes=budget_of(tenant),
                hard_pinned_bytes=u.hard_bytes,
                values=u.values,
            )
        )
    return out


def drop_response(dropped: Dropped) -> pb.DropRetentionResponse:
    """What an operator's drop did."""
    return pb.DropRetentionResponse(values=dropped.values, bytes=dropped.bytes, failed=dropped.failed)
