"""The in-memory store keeps Mooncake's contract: zero-copy in and out, old values kept, sizes checked, faults."""

from __future__ import annotations

import ctypes
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.errors import StoreError
from kvsidecar.store import Pin, Presence, Store, StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar.store.memory_store import MemoryStore


def buffers(*chunks: bytes) -> tuple[list[ctypes.Array[ctypes.c_char]], list[int], list[int]]:
    """ctypes buffers holding chunks, with their addresses and sizes (keep the first item alive)."""
    bufs = [ctypes.create_string_buffer(chunk, len(chunk)) for chunk in chunks]
    return bufs, [ctypes.addressof(b) for b in bufs], [len(c) for c in chunks]


def empty(*sizes: int) -> tuple[list[ctypes.Array[ctypes.c_char]], list[int], list[int]]:
    return buffers(*(b"\0" * s for s in sizes))


def put(store: MemoryStore, key: str, *chunks: bytes) -> StoreCode:
    _keep, addresses, sizes = buffers(*chunks)
    return store.put_from([key], [addresses], [sizes])[0]


def get(store: MemoryStore, key: str, *sizes: int) -> tuple[StoreCode, bytes]:
    bufs, addresses, sizes_ = empty(*sizes)
    code = store.get_into([key], [addresses], [sizes_])[0]
    return code, b"".join(b.raw for b in bufs)


def test_it_satisfies_the_store_protocol():
    store: Store = MemoryStore()
    assert store.health().healthy


def test_multi_buffer_round_trip_concatenates_and_splits_anywhere():
    store = MemoryStore()
    assert put(store, "k", b"abc", b"defgh", b"ij") is StoreCode.OK
    assert store.value("k") == b"abcdefghij"
    assert get(store, "k", 4, 6) == (StoreCode.OK, b"abcdefghij")
    assert get(store, "k", 10) == (StoreCode.OK, b"abcdefghij")


def test_batch_results_are_per_key_and_in_order():
    store = MemoryStore()
    put(store, "b", b"bb")
    bufs, addresses, sizes = empty(2, 2, 2)
    codes = store.get_into(["a", "b", "c"], [[a] for a in addresses], [[s] for s in sizes])
    assert codes == [StoreCode.NOT_FOUND, StoreCode.OK, StoreCode.NOT_FOUND]
    assert [b.raw for b in bufs] == [b"\0\0", b"bb", b"\0\0"]
    assert store.exists(["a", "b"]) == [Presence.ABSENT, Presence.PRESENT]


def test_put_on_an_existing_key_keeps_the_old_value_like_mooncake():
    store = MemoryStore()
    assert put(store, "k", b"old") is StoreCode.OK
    assert put(store, "k", b"new") is StoreCode.OK
    assert get(store, "k", 3) == (StoreCode.OK, b"old")


def test_a_pin_comes_with_the_put_that_creates_a_value_and_changes_only_through_pin_like_mooncake():
    store = MemoryStore()
    _keep, addresses, sizes = buffers(b"abc")
    assert store.put_from(["k"], [addresses], [sizes], pin=Pin(ttl_ms=5000)) == [StoreCode.OK]
    assert store.put_from(["k"], [addresses], [sizes], pin=Pin(hard=True)) == [StoreCode.OK]
    assert store.pin_of("k") == Pin(ttl_ms=5000)  # a put on an existing key keeps its pin
    assert store.pin(["k", "gone", "k"], [3, 3, 4], Pin(hard=True)) == [
        StoreCode.OK,
        StoreCode.NOT_FOUND,
        StoreCode.SIZE_MISMATCH,
    ]
    assert store.pin_of("k") == Pin(hard=True) and store.value("k") == b"abc"
    assert store.pin(["k"], [3], None, hard_before=True) == [StoreCode.OK]
    assert store.pin_of("k") is None
    store.fail_keys(StoreCode.TRANSFER_FAILED, ["k"], ["pin"])
    assert store.pin(["k"], [3], Pin(ttl_ms=1)) == [StoreCode.TRANSFER_FAILED] and store.pin_of("k") is None


@pytest.mark.parametrize("sizes", [(2,), (4,), (1, 1), (2, 2)])
def test_a_get_of_another_total_size_is_a_mismatch_and_writes_nothing(sizes):
    store = MemoryStore()
    put(store, "k", b"abc")
    code, raw = get(store, "k", *sizes)
    assert code is StoreCode.SIZE_MISMATCH
    assert raw == b"\0" * sum(sizes)


def test_capacity_makes_puts_fail_with_no_space_and_remove_frees_it():
    store = MemoryStore(capacity_bytes=10)
    assert put(store, "p/a", b"x" * 6) is StoreCode.OK
    assert put(store, "p/b", b"x" * 5) is StoreCode.NO_SPACE
    assert put(store, "q/c", b"x" * 4) is StoreCode.OK
    assert store.used_bytes == 10
    assert store.remove_prefix("p/") == 1
    assert put(store, "p/b", b"x" * 5) is StoreCode.OK


def test_remove_prefix_removes_only_keys_that_start_with_it():
    store = MemoryStore()
    for key in ("a.b/1", "a.b/2", "a.b", "axb/1", "za.b/1"):
        put(store, key, b"v")
    assert store.remove_prefix("a.b/") == 2
    assert store.keys() == ["a.b", "axb/1", "za.b/1"]
    with pytest.raises(StoreError) as err:
        store.remove_prefix("")
    assert err.value.code is StoreCode.INVALID_PARAMS


@pytest.mark.parametrize(
    "chunks",
    [(), (b"",), (b"a", b"")],
)
def test_empty_values_are_invalid(chunks):
    assert put(MemoryStore(), "k", *chunks) is StoreCode.INVALID_PARAMS


def test_mismatched_batch_shapes_raise_invalid_params():
    store = MemoryStore()
    with pytest.raises(StoreError) as err:
        store.put_from(["a", "b"], [[1]], [[1]])
    assert err.value.code is StoreCode.INVALID_PARAMS
    with pytest.raises(StoreError):
        store.get_into(["a"], [[1, 2]], [[1]])


def test_empty_batches_return_empty_lists():
    store = MemoryStore()
    assert (store.exists([]), store.put_from([], [], []), store.get_into([], [], [])) == ([], [], [])


def test_fail_keys_forces_a_code_for_those_keys_and_operations_only():
    store = MemoryStore()
    put(store, "a", b"1")
    put(store, "b", b"2")
    store.fail_keys(StoreCode.TRANSFER_FAILED, ["a"], ["get"])
    assert get(store, "a", 1) == (StoreCode.TRANSFER_FAILED, b"\0")
    assert get(store, "b", 1) == (StoreCode.OK, b"2")
    assert store.exists(["a"]) == [Presence.PRESENT]
    store.set_fault(None)
    assert get(store, "a", 1) == (StoreCode.OK, b"1")


def test_a_forced_exists_failure_is_unknown_never_present():
    store = MemoryStore()
    put(store, "a", b"1")
    store.fail_keys(StoreCode.RPC_TIMEOUT, ["a", "b"], ["exists"])
    assert store.exists(["a", "b"]) == [Presence.UNKNOWN, Presence.UNKNOWN]
    store.fail_keys(StoreCode.NOT_FOUND, ["a"], ["exists"])
    assert store.exists(["a"]) == [Presence.ABSENT]


def test_fail_next_counts_down_then_behaves():
    store = MemoryStore()
    store.fail_next(StoreCode.NO_SPACE, count=2, operations=["put"])
    _keep, addresses, sizes = buffers(b"1", b"2", b"3")
    codes = store.put_from(["a", "b", "c"], [[a] for a in addresses], [[s] for s in sizes])
    assert codes == [StoreCode.NO_SPACE, StoreCode.NO_SPACE, StoreCode.OK]
    assert store.keys() == ["c"]
    assert put(store, "a", b"1") is StoreCode.OK


def test_a_fault_can_fail_the_whole_call_and_an_ok_from_it_does_no_harm():
    store = MemoryStore()
    put(store, "a", b"1")

    def down(op: str, key: str) -> StoreCode | None:
        raise StoreUnavailable("master unreachable")

    store.set_fault(down)
    with pytest.raises(StoreUnavailable):
        store.exists(["a"])
    store.set_fault(lambda op, key: StoreCode.OK)
    assert get(store, "a", 1) == (StoreCode.OK, b"1")
    assert get(store, "zzz", 1)[0] is StoreCode.NOT_FOUND


def test_unknown_fault_operations_are_rejected():
    with pytest.raises(ValueError, match="unknown operations"):
        MemoryStore().fail_keys(StoreCode.INTERNAL, ["a"], ["delete"])


def test_require_registration_rejects_memory_outside_registered_buffers():
    store = MemoryStore(require_registration=True)
    bufs, addresses, sizes = buffers(b"abcd")
    assert store.put_from(["k"], [addresses], [sizes]) == [StoreCode.INVALID_PARAMS]
    store.register_buffer(addresses[0], 4)
    assert store.put_from(["k"], [[addresses[0] + 1]], [[3]]) == [StoreCode.OK]
    assert store.put_from(["j"], [[addresses[0] + 1]], [[4]]) == [StoreCode.INVALID_PARAMS]
    store.unregister_buffer(addresses[0])
    with pytest.raises(StoreError):
        store.unregister_buffer(addresses[0])
    assert bufs[0].raw == b"abcd"


def test_close_is_idempotent_and_later_calls_raise_unavailable():
    store = MemoryStore()
    put(store, "a", b"1")
    store.close()
    store.close()
    assert not store.health().healthy
    for call in (
        lambda: store.exists(["a"]),
        lambda: store.exists([]),
        lambda: store.put_from([], [], []),
        lambda: store.get_into(["a"], [[1]], [[1]]),
        lambda: store.remove_prefix("a"),
        lambda: store.register_buffer(1, 1),
    ):
        with pytest.raises(StoreUnavailable):
            call()


def test_concurrent_puts_and_gets_from_many_threads_are_consistent():
    store = MemoryStore()
    errors: list[str] = []

    def work(tid: int) -> None:
        for i in range(200):
            key = f"t{tid}/{i}"
            value = f"{tid}:{i}".encode() * 3
            if put(store, key, value[:2], value[2:]) is not StoreCode.OK:
                errors.append(f"put {key}")
            if get(store, key, len(value)) != (StoreCode.OK, value):
                errors.append(f"get {key}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.keys()) == 8 * 200


@given(
    value=st.binary(min_size=1, max_size=64),
    put_cuts=st.lists(st.integers(min_value=1, max_value=63), max_size=4),
    get_cuts=st.lists(st.integers(min_value=1, max_value=63), max_size=4),
)
def test_any_split_of_a_value_reads_back_the_same_bytes(value, put_cuts, get_cuts):
    def split(cuts: list[int]) -> list[bytes]:
        points = sorted({c for c in cuts if c < len(value)})
        return [value[a:b] for a, b in zip([0, *points], [*points, len(value)], strict=True)]

    store = MemoryStore()
    assert put(store, "k", *split(put_cuts)) is StoreCode.OK
    assert get(store, "k", *(len(p) for p in split(get_cuts))) == (StoreCode.OK, value)
