"""Retention: how long the store keeps a request's values ahead of ordinary cache, and how much that matters.

Names and units are those of vLLM's retention RFC (vllm#37003: `priority` 0-100, a `duration` in seconds over a token
range) and of Dynamo (`retention_seconds`, `cache_control: {"type": "ephemeral", "ttl": "5m"}`), where they agree.
`retention_of` reads any of them from a request's parameters (vLLM's `kv_transfer_params`). The daemon's side, and
what Mooncake does with it, is in docs/retention.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar_client.errors import InvalidRequest
from kvsidecar_contract.proto import sidecar_pb2 as pb

__all__ = ["Retention", "parse_ttl", "retention_of"]

MAX_PRIORITY = 100
_TTL = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# Anthropic's and Dynamo's cache_control without a ttl keeps for five minutes.
DEFAULT_CACHE_CONTROL_TTL = "5m"


@dataclass(frozen=True)
class Retention:
    """Keep a request's values at least `seconds` from now ahead of ordinary cache.

    priority (0-100, default 100): the share of the tenant's retention budget the request may fill; past it the
    values are ordinary cache and the save's result says so (`SaveResult.unretained`), never refused. renew: values
    already retained start their time again (each request that asks keeps its prefix for `seconds` from now).
    end_tokens: only the values of tokens [0, end_tokens) (a system prompt), 0 for all. hard: an operator's pin,
    kept until an operator drops it (`kvsidecar retention --drop`); the daemon refuses it to other credentials.
    """

    seconds: float = 0.0
    priority: int | None = None
    renew: bool = True
    end_tokens: int = 0
    hard: bool = False

    def __post_init__(self) -> None:
        if not self.hard and not (math.isfinite(self.seconds) and self.seconds > 0):
            raise InvalidRequest(f"retention: seconds must be > 0 (how long to keep), got {self.seconds!r}")
        if self.priority is not None and not 0 <= self.priority <= MAX_PRIORITY:
            raise InvalidRequest(f"retention: priority is 0-{MAX_PRIORITY}, got {self.priority!r}")
        if self.end_tokens < 0:
            raise InvalidRequest(f"retention: end_tokens must not be negative, got {self.end_tokens!r}")

    def to_proto(self) -> pb.Retention:
        """The wire form."""
        message = pb.Retention(seconds=self.seconds, renew=self.renew, end_tokens=self.end_tokens, hard=self.hard)
        if self.priority is not None:
            message.priority = self.priority
        return message

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> Retention:
        """From {"seconds", "priority", "renew", "end_tokens", "hard"} (a JSON object: vLLM's extra config)."""
        unknown = set(fields) - {"seconds", "priority", "renew", "end_tokens", "hard"}
        if unknown:
            raise InvalidRequest(f"retention: unknown field {sorted(unknown)[0]!r}")
        try:
            return cls(
                seconds=_seconds(fields.get("seconds", 0.0)),
                priority=None if fields.get("priority") is None else int(fields["priority"]),
                renew=bool(fields.get("renew", True)),
                end_tokens=int(fields.get("end_tokens", 0)),
                hard=bool(fields.get("hard", False)),
            )
        except (TypeError, ValueError) as error:
            raise InvalidRequest(f"retention: {error}") from None


def parse_ttl(text: str | float) -> float:
    """Seconds of a TTL as Dynamo and Anthropic write it ("5m", "1h", "30s", "250ms") or a number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = _TTL.fullmatch(str(text))
    if not match:
        raise InvalidRequest(f"retention: not a ttl: {text!r} (a number of seconds, or e.g. 30s, 5m, 1h)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def retention_of(params: Mapping[str, Any] | None, default: Retention | None = None) -> Retention | None:
    """The retention a request's parameters ask for, else `default`; InvalidRequest for one they get wrong.

    Read, first found first: `retention` (this client's fields), `retention_directives` (vLLM's RFC: the directive
    over the prompt's start, its `end` kept for its `duration`), `cache_control` (`{"type": "ephemeral", "ttl":
    "5m"}`), `retention_seconds` with an optional `retention_priority` (Dynamo).
    """
    if not params:
        return default
    if isinstance(params.get("retention"), Mapping):
        return Retention.from_mapping(params["retention"])
    directives = params.get("retention_directives")
    if directives:
        return _from_directives(directives, default)
    control = params.get("cache_control")
    if isinstance(control, Mapping) and control.get("type", "ephemeral") == "ephemeral":
        return Retention(parse_ttl(control.get("ttl", DEFAULT_CACHE_CONTROL_TTL)), _priority(params, default))
    if params.get("retention_seconds") is not None:
        return Retention(parse_ttl(params["retention_seconds"]), _priority(params, default))
    return default


def _from_directives(directives: Any, default: Retention | None) -> Retention | None:
    # The store keeps prefixes: a directive over a range that starts later has no prefix of its own to keep.
    if not isinstance(directives, list) or not all(isinstance(d, Mapping) for d in directives):
        raise InvalidRequest("retention_directives must be a list of {start, end, priority, duration} objects")
    first = next((d for d in directives if int(d.get("start", 0)) == 0), None)
    if first is None:
        return default
    duration = first.get("duration")
    if duration is None:
        if default is None:
            raise InvalidRequest("retention_directives: a directive without a duration needs a default retention")
        duration = default.seconds
    end = first.get("end")
    return Retention(
        parse_ttl(duration),
        None if first.get("priority") is None else int(first["priority"]),
        end_tokens=0 if end is None else int(end),
    )


def _priority(params: Mapping[str, Any], default: Retention | None) -> int | None:
    if params.get("retention_priority") is not None:
        return int(params["retention_priority"])
    return default.priority if default is not None else None


def _seconds(value: Any) -> float:
    return parse_ttl(value) if isinstance(value, str) else float(value)
