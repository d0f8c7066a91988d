"""The embedded master's segments: any segment but this daemon's is a local account's Mooncake client, which the
master would hand some of the daemon's blocks to (it has no authentication). Parsing is pure."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from typing import Any


def foreign_segments(detail: dict[str, Any], own_ports: Iterable[int]) -> list[str]:
    """Segments of /get_segments_detail whose transfer endpoint is not one of this process's Mooncake ports."""
    ports = set(own_ports)
    out = []
    for segment in detail.get("segments", []):
        endpoint = str(segment.get("te_endpoint", ""))
        port = endpoint.rpartition(":")[2]
        if not (port.isdigit() and int(port) in ports):
            out.append(f"{segment.get('segment_name', '?')} (endpoint {endpoint or '?'})")
    return out


def segments_detail(admin_url: str, timeout: float = 2.0) -> dict[str, Any]:
    """The master's /get_segments_detail (its admin HTTP on loopback)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{admin_url}/get_segments_detail", timeout=timeout) as reply:
        detail: dict[str, Any] = json.loads(reply.read())
    return detail
