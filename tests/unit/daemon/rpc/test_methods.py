"""The method table: one row per method of the service, and each way in runs a call as its row says."""

from __future__ import annotations

import pytest

from kvsidecar.rpc import wire
from kvsidecar.rpc.handlers import HANDLERS, handles
from kvsidecar_contract import frames
from kvsidecar_contract.methods import BY_FRAME, BY_NAME, METHODS
from kvsidecar_contract.proto import sidecar_pb2 as pb


def test_every_method_of_the_service_has_one_row_with_its_messages_and_one_handler():
    service = pb.DESCRIPTOR.services_by_name["Sidecar"]
    assert sorted(m.name for m in METHODS) == sorted(m.name for m in service.methods)
    for method in service.methods:
        row = BY_NAME[method.name]
        assert row.request.DESCRIPTOR is method.input_type and row.response.DESCRIPTOR is method.output_type
    assert set(HANDLERS) == set(BY_NAME)
    with pytest.raises(AssertionError, match="no row"):
        handles("Ping")


def test_the_data_socket_carries_saves_loads_and_lookups_under_their_numbers():
    assert {number: row.name for number, row in BY_FRAME.items()} == {
        1: "Save",
        2: "SaveBatch",
        3: "Load",
        4: "LoadBatch",
        5: "Lookup",
    }
    assert frames.HELLO not in BY_FRAME and {row.name: n for n, row in BY_FRAME.items()} == frames.METHOD_IDS
    assert [row.name for row in METHODS if row.gate] == ["Lookup"]


def test_parsers_are_built_once_and_only_lookups_are_bounded_by_the_hash_limit():
    save = BY_NAME["Save"]
    assert wire.request_parser(save, 4) is wire.request_parser(save, 1 << 17)
    lookup = BY_NAME["Lookup"]
    assert wire.request_parser(lookup, 4) is wire.request_parser(lookup, 4)
    big = pb.LookupRequest(session_id="s", block_hashes=[b"\x02" * 32] * 5000).SerializeToString()
    assert isinstance(wire.request_parser(lookup, 4)(big), wire.Oversized)
    assert wire.request_parser(lookup, 1 << 17)(big).session_id == "s"
    assert isinstance(wire.request_parser(save, 4)(b"\xff\xff\xff"), wire.Undecodable)
