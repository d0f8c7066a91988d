"""The store adapter's speed-ups that `kvsidecar bench` measures: a pre-faulted segment, split existence checks."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from kvsidecar.store import Presence, StoreCode

pytestmark = pytest.mark.integration


def test_the_segment_is_prefaulted_in_the_background(connect_mooncake, mooncake_settings, mooncake_master):
    store = connect_mooncake(mooncake_settings(mooncake_master))
    assert store.prefault is not None and store.prefault.done.wait(60)
    assert store.prefault.bytes == store.settings.global_segment_size
    buf = ctypes.create_string_buffer(b"x" * 4096)
    assert store.put_from(["prefault/after"], [[ctypes.addressof(buf)]], [[4096]]) == [StoreCode.OK]
    assert store.remove(["prefault/after"]) == [StoreCode.OK]
    plain = connect_mooncake(dataclasses.replace(mooncake_settings(mooncake_master), prefault_segment=False))
    assert plain.prefault is None


@pytest.mark.parametrize("count", [2500, 24000])  # split from 2,048 keys on: two parts, and as many as there are cores
def test_a_long_existence_check_keeps_every_answer_in_place(mooncake_store, key_prefix, count):
    value = ctypes.create_string_buffer(8)
    stored = [f"{key_prefix}{i}" for i in range(0, count, 3)]
    for i in range(0, len(stored), 4000):
        part = stored[i : i + 4000]
        codes = mooncake_store.put_from(part, [[ctypes.addressof(value)]] * len(part), [[8]] * len(part))
        assert set(codes) == {StoreCode.OK}
    keys = [f"{key_prefix}{i}" for i in range(count)]  # large enough to be split across parallel calls
    presence = mooncake_store.exists(keys)
    assert presence == [Presence.PRESENT if i % 3 == 0 else Presence.ABSENT for i in range(count)]
