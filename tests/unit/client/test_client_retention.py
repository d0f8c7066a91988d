"""Retention as engines ask for it: this client's fields, vLLM's retention directives, Dynamo's cache_control and
retention_seconds, read into one Retention with the reason for what is wrong."""

from __future__ import annotations

import pytest

from kvsidecar_client import InvalidRequest, Retention
from kvsidecar_client.batch import SaveItem, save_items
from kvsidecar_client.retention import parse_ttl, retention_of
from kvsidecar_contract.proto import sidecar_pb2 as pb

DEFAULT = Retention(600, priority=40)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, DEFAULT),
        ({}, DEFAULT),
        ({"other": 1}, DEFAULT),
        ({"retention": {"seconds": "2m", "priority": 80, "renew": False}}, Retention(120, 80, renew=False)),
        ({"retention": {"hard": True}}, Retention(hard=True)),
        # vLLM's RFC: the directive over the prompt's start; one starting later has no prefix to keep.
        ({"retention_directives": [{"start": 0, "end": 512, "priority": 90, "duration": 12.5}]},
         Retention(12.5, 90, end_tokens=512)),
        ({"retention_directives": [{"start": 64, "end": 512, "priority": 90, "duration": 30}]}, DEFAULT),
        ({"retention_directives": [{"start": 0, "end": 32, "priority": 70}]}, Retention(600, 70, end_tokens=32)),
        # Dynamo and Anthropic: cache_control with a ttl (five minutes without one), retention_seconds.
        ({"cache_control": {"type": "ephemeral", "ttl": "1h"}}, Retention(3600, 40)),
        ({"cache_control": {"type": "ephemeral"}}, Retention(300, 40)),
        ({"retention_seconds": 90, "retention_priority": 10}, Retention(90, 10)),
    ],
)  # fmt: skip
def test_every_way_engines_ask_for_retention_reads_into_one(params, expected):
    assert retention_of(params, DEFAULT) == expected


def test_what_is_wrong_is_named():
    for params, reason in (
        ({"retention": {"seconds": 0}}, "seconds must be > 0"),
        ({"retention": {"seconds": 5, "priority": 101}}, "priority is 0-100"),
        ({"retention": {"seconds": 5, "ttl": 3}}, "unknown field 'ttl'"),
        ({"cache_control": {"type": "ephemeral", "ttl": "soon"}}, "not a ttl"),
        ({"retention_directives": "all"}, "must be a list"),
        ({"retention_directives": [{"start": 0, "end": 8}]}, "needs a default retention"),
    ):
        with pytest.raises(InvalidRequest, match=reason):
            retention_of(params)
    assert [parse_ttl(t) for t in ("250ms", "30s", "5m", "1.5h", 7, "12")] == [0.25, 30, 300, 5400, 7, 12]


def test_a_save_carries_its_own_retention_or_the_default_on_the_wire():
    ids = lambda block_ids: [pb.BlockIds(ids=g) for g in block_ids]  # noqa: E731
    items = [SaveItem("a", [b"h" * 32], [[1]], 16), SaveItem("b", [b"h" * 32], [[1]], 16, retention=Retention(5))]
    a, b = (item.request for item in save_items(items, ids, Retention(60, 30, end_tokens=16)).open())
    assert (a.retention.seconds, a.retention.priority, a.retention.end_tokens, a.retention.renew) == (60, 30, 16, True)
    assert (b.retention.seconds, b.retention.HasField("priority")) == (5, False)
    (plain,) = save_items(items[:1], ids).open()
    assert not plain.request.HasField("retention")
