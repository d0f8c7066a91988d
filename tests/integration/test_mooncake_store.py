"""MooncakeStore against a real mooncake_master: zero-copy bytes, typed failures, never wrong data."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvsidecar.daemon.master import EmbeddedMaster
from kvsidecar.errors import StoreError
from kvsidecar.store import Presence, StoreCode
from kvsidecar.store.base import StoreUnavailable
from kvsidecar.store.mooncake_store import MooncakeSettings, MooncakeStore, prefix_regex

# Master-down calls return after ~4.6 s (measured); anything near this bound is a hang.
CALL_BOUND_S = 15.0


class Buffers:
    """Some memory of one kind (ctypes, torch CPU, numpy) split into buffers: their addresses, sizes and bytes."""

    def __init__(self, kind: str, sizes: list[int], fill: bytes | None = None) -> None:
        total = sum(sizes)
        data = fill if fill is not None else bytes(total)
        if kind == "ctypes":
            self._mem = ctypes.create_string_buffer(data, total)
            base = ctypes.addressof(self._mem)
            self._read = lambda: self._mem.raw
        elif kind == "torch":
            self._mem = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
            base = self._mem.data_ptr()
            self._read = lambda: bytes(self._mem.tolist())
        elif kind == "numpy":
            np = pytest.importorskip("numpy")
            self._mem = np.frombuffer(bytearray(data), dtype=np.uint8).copy()
            base = self._mem.ctypes.data
            self._read = lambda: self._mem.tobytes()
        else:
            raise ValueError(kind)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.addresses = [base + o for o in offsets]
        self.sizes = list(sizes)

    def bytes(self) -> bytes:
        return self._read()


def pattern(tag: str, n: int) -> bytes:
    """n bytes that differ for every tag."""
    seed = tag.encode() + b"#"
    return (seed * (n // len(seed) + 1))[:n]


def put(store: MooncakeStore, key: str, value: bytes, sizes: list[int], kind: str = "ctypes") -> StoreCode:
    src = Buffers(kind, sizes, value)
    return store.put_from([key], [src.addresses], [src.sizes])[0]


def get(store: MooncakeStore, key: str, sizes: list[int], kind: str = "ctypes") -> tuple[StoreCode, bytes]:
    dst = Buffers(kind, sizes)
    code = store.get_into([key], [dst.addresses], [dst.sizes])[0]
    return code, dst.bytes()


# --- Pure parts: no master needed ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "regex"),
    [
        ("ns/model@x/", "^ns\\/model@x\\/"),
        ("a.b*c+d?e(f)g[h]i{j}k|l^m$n\\o", "^a\\.b\\*c\\+d\\?e\\(f\\)g\\[h\\]i\\{j\\}k\\|l\\^m\\$n\\\\o"),
        ("plain-key_1:2 #&~", "^plain-key_1:2 #&~"),
    ],
)
def test_prefix_regex_escapes_every_special_character(prefix, regex):
    assert prefix_regex(prefix) == regex
    assert re.search(regex, prefix + "tail") and not re.search(regex, "x" + prefix)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("global_segment_size", 1 << 20, "at least"),
        ("local_buffer_size", -1, "negative"),
        ("replica_num", 0, "at least 1"),
        ("master_server_addr", "", "must not be empty"),
    ],
)
def test_settings_reject_values_mooncake_would_refuse(field, value, message):
    fields: dict[str, object] = {"local_hostname": "127.0.0.1", "master_server_addr": "127.0.0.1:1", field: value}
    with pytest.raises(ValueError, match=message):
        MooncakeSettings(**fields)  # type: ignore[arg-type]


def test_settings_defaults_are_single_node_tcp():
    s = MooncakeSettings(local_hostname="127.0.0.1", master_server_addr="127.0.0.1:50051")
    assert (s.metadata_server, s.protocol, s.rdma_devices, s.replica_num) == ("P2PHANDSHAKE", "tcp", "", 1)
    assert MooncakeSettings(local_hostname="h", master_server_addr="m", global_segment_size=0).global_segment_size == 0


# --- Against the session master ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ctypes", "torch", "numpy"])
def test_multi_buffer_values_round_trip_byte_for_byte(mooncake_store, key_prefix, kind):
    layouts = {"one": [4096], "three": [1000, 1, 70000], "many": [512] * 16}
    keys = [f"{key_prefix}{name}" for name in layouts]
    sources = [
        Buffers(kind, sizes, pattern(key, sum(sizes))) for key, sizes in zip(keys, layouts.values(), strict=True)
    ]
    codes = mooncake_store.put_from(keys, [s.addresses for s in sources], [s.sizes for s in sources])
    assert codes == [StoreCode.OK] * 3
    assert mooncake_store.exists(keys) == [Presence.PRESENT] * 3
    targets = [Buffers(kind, sizes) for sizes in layouts.values()]
    codes = mooncake_store.get_into(keys, [t.addresses for t in targets], [t.sizes for t in targets])
    assert codes == [StoreCode.OK] * 3
    assert [t.bytes() for t in targets] == [s.bytes() for s in sources]


@pytest.mark.integration
def test_a_value_reads_back_into_any_split_of_the_same_total(mooncake_store, key_prefix):
    key = f"{key_prefix}k"
    value = pattern(key, 300)
    assert put(mooncake_store, key, value, [100, 200]) is StoreCode.OK
    assert get(mooncake_store, key, [300], kind="torch") == (StoreCode.OK, value)
    assert get(mooncake_store, key, [1, 149, 150]) == (StoreCode.OK, value)


@pytest.mark.integration
def test_exists_tells_present_from_absent(mooncake_store, key_prefix):
    put(mooncake_store, f"{key_prefix}here", b"v" * 64, [64])
    found = mooncake_store.exists([f"{key_prefix}here", f"{key_prefix}gone", f"{key_prefix}here"])
    assert found == [Presence.PRESENT, Presence.ABSENT, Presence.PRESENT]


@pytest.mark.integration
def test_put_on_an_existing_key_keeps_the_old_value(mooncake_store, key_prefix):
    key = f"{key_prefix}k"
    assert put(mooncake_store, key, b"o" * 128, [128]) is StoreCode.OK
    assert put(mooncake_store, key, b"n" * 128, [64, 64]) is StoreCode.OK
    assert get(mooncake_store, key, [128]) == (StoreCode.OK, b"o" * 128)


@pytest.mark.integration
def test_a_missing_key_is_not_found_and_its_buffer_untouched(mooncake_store, key_prefix):
    dst = Buffers("ctypes", [256], b"\xee" * 256)
    codes = mooncake_store.get_into([f"{key_prefix}missing"], [dst.addresses], [dst.sizes])
    assert codes == [StoreCode.NOT_FOUND]
    assert dst.bytes() == b"\xee" * 256


@pytest.mark.integration
@pytest.mark.parametrize(
    "sizes", [[255], [257], [128, 127], [256, 1]], ids=["short", "long", "split-short", "split-long"]
)
def test_a_get_of_the_wrong_total_size_is_a_size_mismatch(mooncake_store, key_prefix, sizes):
    key = f"{key_prefix}k"
    assert put(mooncake_store, key, pattern(key, 256), [256]) is StoreCode.OK
    keys = [key, f"{key_prefix}missing"]
    dst = [Buffers("ctypes", sizes), Buffers("ctypes", sizes)]
    codes = mooncake_store.get_into(keys, [d.addresses for d in dst], [d.sizes for d in dst])
    assert codes == [StoreCode.SIZE_MISMATCH, StoreCode.NOT_FOUND]


@pytest.mark.integration
def test_remove_prefix_removes_exactly_that_prefix(mooncake_store, key_prefix):
    doomed = [f"{key_prefix}a.b*/1", f"{key_prefix}a.b*/2"]
    # Each survivor would match if the prefix were used as a bare regex or without the anchor.
    survivors = [f"{key_prefix}a.b*", f"{key_prefix}axb*/1", f"{key_prefix}a.bbb/1", f"x{key_prefix}a.b*/1"]
    for key in doomed + survivors:
        assert put(mooncake_store, key, b"v" * 16, [16]) is StoreCode.OK
    assert mooncake_store.remove_prefix(f"{key_prefix}a.b*/") == 2
    assert mooncake_store.exists(doomed + survivors) == [Presence.ABSENT] * 2 + [Presence.PRESENT] * 4
    assert mooncake_store.remove_prefix(f"x{key_prefix}") == 1
    with pytest.raises(StoreError) as err:
        mooncake_store.remove_prefix("")
    assert err.value.code is StoreCode.INVALID_PARAMS


@pytest.mark.integration
def test_empty_and_malformed_batches(mooncake_store, key_prefix):
    assert mooncake_store.exists([]) == []
    assert mooncake_store.put_from([], [], []) == []
    assert mooncake_store.get_into([], [], []) == []
    with pytest.raises(StoreError) as err:
        mooncake_store.put_from([f"{key_prefix}a", f"{key_prefix}b"], [[1]], [[1]])
    assert err.value.code is StoreCode.INVALID_PARAMS
    with pytest.raises(StoreError):
        mooncake_store.get_into([f"{key_prefix}a"], [[1, 2]], [[1]])


@pytest.mark.integration
def test_register_and_unregister_a_buffer(mooncake_store):
    mem = torch.zeros(1 << 20, dtype=torch.uint8)
    mooncake_store.register_buffer(mem.data_ptr(), mem.numel())
    mooncake_store.unregister_buffer(mem.data_ptr())
    with pytest.raises(StoreError) as err:
        mooncake_store.unregister_buffer(mem.data_ptr())
    assert err.value.code is StoreCode.INVALID_PARAMS


@pytest.mark.integration
def test_health_names_the_master(mooncake_store, mooncake_master):
    health = mooncake_store.health()
    assert health.healthy and mooncake_master.address in health.detail


@pytest.mark.integration
def test_many_threads_at_once_get_their_own_bytes(mooncake_store, key_prefix):
    errors: list[str] = []

    def work(tid: int) -> None:
        for round_ in range(15):
            keys = [f"{key_prefix}{tid}/{round_}/{i}" for i in range(8)]
            src = [Buffers("ctypes", [3000, 5000], pattern(k, 8000)) for k in keys]
            if mooncake_store.put_from(keys, [s.addresses for s in src], [s.sizes for s in src]) != [StoreCode.OK] * 8:
                errors.append(f"put {tid}/{round_}")
            if mooncake_store.exists(keys) != [Presence.PRESENT] * 8:
                errors.append(f"exists {tid}/{round_}")
            dst = [Buffers("ctypes", [8000]) for _ in keys]
            if mooncake_store.get_into(keys, [d.addresses for d in dst], [d.sizes for d in dst]) != [StoreCode.OK] * 8:
                errors.append(f"get {tid}/{round_}")
            if [d.bytes() for d in dst] != [s.bytes() for s in src]:
                errors.append(f"bytes {tid}/{round_}")
            mooncake_store.health()
            if mooncake_store.remove_prefix(f"{key_prefix}{tid}/{round_}/") != 8:
                errors.append(f"remove {tid}/{round_}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- Lifecycle: stores of their own -----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.usefixtures("mooncake_store")  # removes key_prefix afterwards: the value may sit in another segment
def test_after_close_every_call_raises_unavailable_instead_of_crashing(
    connect_mooncake, mooncake_settings, mooncake_master, key_prefix
):
    store = connect_mooncake(mooncake_settings(mooncake_master))
    key = f"{key_prefix}k"
    assert put(store, key, b"v" * 32, [32]) is StoreCode.OK
    outcomes: list[str] = []
    hammering = threading.Event()

    def hammer() -> None:
        # Calls racing with close() must either finish normally or raise StoreUnavailable: never reach a closed client.
        deadline = time.monotonic() + CALL_BOUND_S
        while time.monotonic() < deadline:
            try:
                store.exists([key])
            except StoreUnavailable:
                outcomes.append("unavailable")
                return
            hammering.set()
        outcomes.append("never closed")

    racer = threading.Thread(target=hammer)
    racer.start()
    assert hammering.wait(CALL_BOUND_S), "no call answered before close"
    store.close()
    racer.join()
    assert outcomes == ["unavailable"]
    store.close()
    assert store.closed
    dst = Buffers("ctypes", [32])
    calls: list[Callable[[], object]] = [
        lambda: store.exists([key]),
        lambda: store.exists([]),
        lambda: store.put_from([key], [dst.addresses], [dst.sizes]),
        lambda: store.get_into([key], [dst.addresses], [dst.sizes]),
        lambda: store.get_into([], [], []),
        lambda: store.remove_prefix(key_prefix),
        lambda: store.register_buffer(dst.addresses[0], 32),
        lambda: store.unregister_buffer(dst.addresses[0]),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable):
            call()
    assert store.health() == (False, "the Mooncake store is closed")


@pytest.mark.integration
def test_connect_without_a_master_is_unavailable_with_the_reason(connect_mooncake, mooncake_settings):
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"master 127\.0\.0\.1:1,.*mooncake_master listening"):
        connect_mooncake(mooncake_settings("127.0.0.1:1"))
    assert time.monotonic() - started < CALL_BOUND_S


@pytest.fixture
def own_master():
    master = EmbeddedMaster().start()
    yield master
    master.stop()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    return fn(), time.monotonic() - started


@pytest.mark.integration
def test_master_killed_then_restarted(own_master, connect_mooncake, mooncake_settings, key_prefix):
    store = connect_mooncake(mooncake_settings(own_master))
    key = f"{key_prefix}k"
    value = pattern(key, 4096)
    assert put(store, key, value, [4096]) is StoreCode.OK

    os.kill(own_master.pid, signal.SIGKILL)
    dst = Buffers("ctypes", [4096], b"\xee" * 4096)
    src = Buffers("ctypes", [4096], value)
    results: dict[str, tuple[object, float]] = {}
    calls: dict[str, Callable[[], object]] = {
        "exists": lambda: store.exists([key]),
        "get": lambda: store.get_into([key], [dst.addresses], [dst.sizes]),
        "put": lambda: store.put_from([f"{key_prefix}new"], [src.addresses], [src.sizes]),
    }
    threads = [threading.Thread(target=lambda n=n, c=c: results.update({n: timed(c)})) for n, c in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_BOUND_S + 5)
    assert not any(t.is_alive() for t in threads), "a store call hung with the master down"
    assert all(seconds < CALL_BOUND_S for _, seconds in results.values()), results
    assert results["exists"][0] == [Presence.UNKNOWN]
    assert results["get"][0] in ([StoreCode.RPC_FAILED], [StoreCode.RPC_TIMEOUT])
    assert results["put"][0] in ([StoreCode.RPC_FAILED], [StoreCode.RPC_TIMEOUT])
    assert dst.bytes() == b"\xee" * 4096
    # The client notices through its background ping; health lags the death by a few seconds.
    assert wait_for(lambda: not store.health().healthy, CALL_BOUND_S)

    own_master.restart()
    # The client reconnects by itself and re-mounts its segment; the new master has nothing of the old one.
    assert wait_for(lambda: store.health().healthy, CALL_BOUND_S)
    assert wait_for(lambda: put(store, f"{key_prefix}after", value, [4096]) is StoreCode.OK, CALL_BOUND_S)
    assert store.exists([key, f"{key_prefix}after"]) == [Presence.ABSENT, Presence.PRESENT]
    assert get(store, key, [4096])[0] is StoreCode.NOT_FOUND
    assert get(store, f"{key_prefix}after", [4096]) == (StoreCode.OK, value)


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def test_remove_forces_out_listed_keys_only(mooncake_store, key_prefix):
    import ctypes

    buf = ctypes.create_string_buffer(b"v" * 64, 64)
    keys = [f"{key_prefix}/a", f"{key_prefix}/b", f"{key_prefix}/c"]
    addr = ctypes.addressof(buf)
    assert mooncake_store.put_from(keys, [[addr]] * 3, [[64]] * 3) == [StoreCode.OK] * 3
    assert mooncake_store.exists(keys[:1]) == [Presence.PRESENT]  # takes a lease: force must still remove it
    assert mooncake_store.remove([*keys[:2], f"{key_prefix}/never"]) == [
        StoreCode.OK,
        StoreCode.OK,
        StoreCode.NOT_FOUND,
    ]
    assert mooncake_store.exists(keys) == [Presence.ABSENT, Presence.ABSENT, Presence.PRESENT]
