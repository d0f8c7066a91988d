"""MooncakeStore's `pin` against a real mooncake_master under pressure: a stored value's pin changes (soft, hard,
none again) and its bytes stay (docs/retention.md has the measurements behind store/pins.py). What pins do to
eviction through the daemon, time running out included, is tests/integration/test_retention.py's."""

from __future__ import annotations

import ctypes
import time

import pytest

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.store import Pin, StoreCode
from kvsidecar.store.mooncake_store import MIN_GLOBAL_SEGMENT_SIZE, MooncakeStore

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture(scope="module")
def pressure(mooncake_client_env, mooncake_settings):
    """A master of its own (reads lease keys for 100 ms only) and a store with a 16 MiB segment."""
    master = EmbeddedMaster(env=mooncake_client_env.variables(), lease_ttl_ms=100).start()
    store = MooncakeStore.connect(mooncake_settings(master, global_segment_size=MIN_GLOBAL_SEGMENT_SIZE))
    yield store
    store.close()
    master.stop()


class Values:
    """1 MiB values, each key's bytes its own."""

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(MIB)
        self.address = ctypes.addressof(self.buffer)

    def put(self, store: MooncakeStore, keys: list[str], pin: Pin | None = None) -> None:
        for key in keys:
            self.buffer.raw = (key.encode() * MIB)[:MIB]
            # A full segment refuses puts until the master's background eviction has made room.
            deadline = time.monotonic() + 30
            while (code := store.put_from([key], [[self.address]], [[MIB]], pin=pin)[0]) is StoreCode.NO_SPACE:
                assert time.monotonic() < deadline, f"{key}: the store stayed full"
                time.sleep(0.01)
            assert code is StoreCode.OK

    def intact(self, store: MooncakeStore, key: str) -> bool:
        assert store.get_into([key], [[self.address]], [[MIB]]) == [StoreCode.OK]
        return self.buffer.raw == (key.encode() * MIB)[:MIB]


def there(store: MooncakeStore, keys: list[str]) -> str:
    """Which keys are stored, without a read lease: 1 there, . gone."""
    return "".join("1" if tier else "." for tier in store.tiers(keys))


def test_pin_changes_a_stored_values_pin_and_keeps_its_bytes(pressure, key_prefix):
    store, values = pressure, Values()
    soft = [f"{key_prefix}s{i}" for i in range(2)]
    hard = [f"{key_prefix}h{i}" for i in range(2)]
    values.put(store, soft + hard)  # ordinary, as a save without retention left them
    assert store.pin(soft, [MIB, MIB], Pin(ttl_ms=60_000)) == [StoreCode.OK] * 2
    assert store.pin(hard, [MIB, MIB], Pin(hard=True)) == [StoreCode.OK] * 2
    gone = f"{key_prefix}never"
    assert store.pin([gone], [MIB], Pin(ttl_ms=60_000)) == [StoreCode.NOT_FOUND]
    values.put(store, [f"{key_prefix}flood{i}" for i in range(40)])
    assert there(store, soft + hard + [gone]) == "1111."
    assert all(values.intact(store, k) for k in soft + hard)
    # A soft pin taken away (an operator's drop): ordinary cache again.
    assert store.pin(soft, [MIB, MIB], None) == [StoreCode.OK] * 2
    assert store.pin(hard, [MIB, MIB], None, hard_before=True) == [StoreCode.OK] * 2
    values.put(store, [f"{key_prefix}again{i}" for i in range(40)])
    assert there(store, soft + hard) == "...."
