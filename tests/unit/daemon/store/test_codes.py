"""Mooncake's return codes become typed StoreCodes in one table; failures are typed errors."""

from __future__ import annotations

import pytest

from kvsidecar.errors import StoreError
from kvsidecar.reasons import Reason
from kvsidecar.store import Presence, StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar.store.codes import (
    SUCCESS,
    Health,
    from_mooncake,
    presence_from_mooncake,
    presence_of_failure,
)

MOONCAKE_CODES = [
    (-1, StoreCode.INTERNAL),
    (-101, StoreCode.SEGMENT_NOT_FOUND),
    (-200, StoreCode.NO_SPACE),
    (-600, StoreCode.INVALID_PARAMS),
    (-704, StoreCode.NOT_FOUND),
    (-705, StoreCode.EXISTS),
    (-706, StoreCode.LEASED),
    (-707, StoreCode.LEASE_EXPIRED),
    (-800, StoreCode.TRANSFER_FAILED),
    (-900, StoreCode.RPC_FAILED),
    (-901, StoreCode.RPC_TIMEOUT),
]


@pytest.mark.parametrize(("number", "code"), MOONCAKE_CODES)
def test_each_documented_number_has_its_code(number, code):
    assert from_mooncake(number) is code


@pytest.mark.parametrize("value", [0, 1, 4096, 1 << 40])
def test_zero_and_byte_counts_are_ok(value):
    assert from_mooncake(value) is StoreCode.OK


@pytest.mark.parametrize("number", [-2, -100, -201, -703, -708, -902, -999999])
def test_unknown_negative_numbers_are_internal_never_ok(number):
    assert from_mooncake(number) is StoreCode.INTERNAL


def test_labels_are_unique_lowercase_metric_labels():
    labels = [code.value for code in StoreCode]
    assert len(labels) == len(set(labels))
    assert all(label.isidentifier() and label == label.lower() for label in labels)


def test_codes_that_only_kvsidecar_produces_have_no_number():
    mapped = {code for _, code in MOONCAKE_CODES}
    assert set(StoreCode) - mapped == {
        StoreCode.OK,
        StoreCode.SIZE_MISMATCH,
        StoreCode.UNAVAILABLE,
        StoreCode.DEADLINE_EXCEEDED,
    }


def test_store_error_carries_code_and_reason():
    err = StoreError(StoreCode.NO_SPACE, "segment full")
    assert (err.code, err.reason, str(err)) == (StoreCode.NO_SPACE, "segment full", "no_space: segment full")


def test_unavailable_is_a_store_error_with_the_unavailable_code():
    err = StoreUnavailable("master 127.0.0.1:1 unreachable")
    assert isinstance(err, StoreError)
    assert (err.code, str(err)) == (StoreCode.UNAVAILABLE, "unavailable: master 127.0.0.1:1 unreachable")


def test_existence_results_map_only_one_and_zero_to_an_answer():
    assert presence_from_mooncake([1, 0, -1, -900, 2]) == [
        Presence.PRESENT,
        Presence.ABSENT,
        Presence.UNKNOWN,
        Presence.UNKNOWN,
        Presence.UNKNOWN,
    ]


def test_a_failed_check_is_unknown_unless_the_key_is_known_missing():
    assert presence_of_failure(StoreCode.NOT_FOUND) is Presence.ABSENT
    assert {presence_of_failure(c) for c in StoreCode if c is not StoreCode.NOT_FOUND} == {Presence.UNKNOWN}


def test_health_check_numbers():
    assert (Health(0), Health(1), Health(2)) == (Health.HEALTHY, Health.NOT_INITIALIZED, Health.MASTER_UNREACHABLE)
    assert SUCCESS == 0


def test_every_store_failure_is_a_reason_and_the_daemons_own_are_no_store_code():
    for code in StoreCode:
        if code is not StoreCode.OK:
            assert Reason.of(code).value == code.value
    with pytest.raises(ValueError, match="no failure reason"):
        Reason.of(StoreCode.OK)
    own = {Reason.NO_BLOCK, Reason.TENANT_BUDGET, Reason.CHECKSUM_MISMATCH}
    assert {r.value for r in own} == {"no_block", "tenant_budget", "checksum_mismatch"}
    assert not {r.value for r in own} & {code.value for code in StoreCode}
    assert {r.value for r in Reason} == {c.value for c in StoreCode if c is not StoreCode.OK} | {r.value for r in own}
