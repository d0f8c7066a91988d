"""The Store over Mooncake's MooncakeDistributedStore: the only module that imports mooncake.

Behaviour of the native client this adapter is built around (mooncake-transfer-engine-non-cuda 0.3.13.post1,
measured on 2 cores over loopback):

- Concurrency: batch calls release the GIL and tolerate concurrent use; 16 threads mixing batch put / exists /
  get / remove_by_regex / health_check on one client for 800 rounds gave no errors and no wrong bytes. So calls run
  in parallel here; the only lock guards the native object's lifetime against close().
- After close() any call segfaults the process, so close() waits for calls in flight and later calls raise
  StoreUnavailable before reaching native code.
- Master killed (-9): every call returns -900 (RPC_FAILED) per key (batch_is_exist too, not -1), either at once or,
  while the client's background reconnect is under way, after about 4.2-4.6 s, independent of MC_RPC_TIMEOUT_MS and
  MC_RPC_CONNECT_TIMEOUT_MS. health_check() still says 0 for 0.8-5 s after the kill, then 2. Nothing is written into
  get buffers.
- Master hung (SIGSTOP): every call returns -901 (RPC_TIMEOUT) after MC_RPC_TIMEOUT_MS (default 30 s). That is the
  bound on any call, so no call hangs forever; set MC_RPC_TIMEOUT_MS at the edge to tighten it. A Python-side
  timeout around a call would be unsafe: the abandoned native get could still write into buffers the caller has
  already reused.
- Master restarted on the same address: the client reconnects by itself within about 1-2 s. The new master has no
  keys (exists -> 0, get -> -704), and puts fail with -200 until the client has re-mounted its segment (~1 s).
- close() takes 1-2 s with the master up and 10-15 s with it down.
- First touch: a put into segment memory never written before pays a page fault per 4 KiB page (0.3-1.4 GiB/s per
  put here, against 7-9 GiB/s into touched memory), and a segment stays that cold until it has filled once. So the
  daemon pre-faults its segment once, in the background (`prefault.SegmentPrefault`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from kvsidecar.errors import StoreError
from kvsidecar.store.base import Pin, Presence, Replica, StoreHealth, StoreUnavailable, check_batch_shapes
from kvsidecar.store.codes import SUCCESS, Health, StoreCode, from_mooncake, presence_from_mooncake
from kvsidecar.store.pins import Scratch, replicate_config, rewrite
from kvsidecar.store.prefault import SegmentPrefault, locate_segment
from kvsidecar.store.setup_output import quiet_setup

__all__ = [
    "DEFAULT_GLOBAL_SEGMENT_SIZE",
    "DEFAULT_LOCAL_BUFFER_SIZE",
    "MIN_GLOBAL_SEGMENT_SIZE",
    "MooncakeSettings",
    "MooncakeStore",
    "prefix_regex",
]

MIB = 1 << 20
MIN_GLOBAL_SEGMENT_SIZE = 16 * MIB  # Mooncake rejects smaller non-zero segments with -600
DEFAULT_GLOBAL_SEGMENT_SIZE = 1024 * MIB
DEFAULT_LOCAL_BUFFER_SIZE = 16 * MIB

# Characters with a meaning in the ECMAScript regex grammar the master uses; everything else stands for itself.
_REGEX_SPECIAL = frozenset("\\^$.*+?()[]{}|/")

_T = TypeVar("_T")
log = logging.getLogger(__name__)
# An existence check of at least 2 x _EXISTS_PART_KEYS keys is split into up to _EXISTS_PARTS concurrent calls.
_EXISTS_PARTS = max(1, min(4, os.cpu_count() or 1))
_EXISTS_PART_KEYS = 1024
_COMPLETE = 3  # mooncake.store.ReplicaStatus.COMPLETE: a replica whose bytes are all written


@dataclass(frozen=True, kw_only=True)
class MooncakeSettings:
    """How to set up the Mooncake client."""

    local_hostname: str
    master_server_addr: str
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    protocol: str = "tcp"
    rdma_devices: str = ""
    replica_num: int = 1
    # Fault the whole segment in once, in the background, so puts never pay first-touch page faults.
    prefault_segment: bool = True

    def __post_init__(self) -> None:
        if not self.local_hostname:
            raise ValueError("local_hostname must not be empty")
        if not self.master_server_addr:
            raise ValueError("master_server_addr must not be empty")
        if not self.protocol:
            raise ValueError("protocol must not be empty")
        if self.global_segment_size != 0 and self.global_segment_size < MIN_GLOBAL_SEGMENT_SIZE:
            raise ValueError(
                f"global_segment_size must be 0 (contribute no memory) or at least {MIN_GLOBAL_SEGMENT_SIZE} "
                f"bytes, got {self.global_segment_size}"
            )
        if self.local_buffer_size < 0:
            raise ValueError(f"local_buffer_size must not be negative, got {self.local_buffer_size}")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be at least 1, got {self.replica_num}")


def prefix_regex(prefix: str) -> str:
    """An anchored regex matching exactly the keys that start with prefix."""
    return "^" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in prefix)


class MooncakeStore:
    """A Store backed by one MooncakeDistributedStore client."""

    def __init__(self, native: Any, settings: MooncakeSettings, config_type: Any) -> None:
        """Wrap a client whose setup() has already succeeded (config_type: Mooncake's ReplicateConfig); use
        connect() to build one."""
        self._native: Any = native
        self._settings = settings
        self._config_type = config_type
        self._replicate_config = replicate_config(config_type, settings.replica_num, None)
        self._scratch = Scratch()  # where values are read to be written back with another pin
        self._lifetime = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self.prefault: SegmentPrefault | None = None
        self._segment: Replica | None = None
        self._exists_pool = ThreadPoolExecutor(_EXISTS_PARTS, thread_name_prefix="kvsidecar-exists")
        self._health_note = ""  # appended to the health detail (the disk tier's recovery at start)

    @classmethod
    def connect(cls, settings: MooncakeSettings) -> MooncakeStore:
        """Set up a Mooncake client; raise StoreUnavailable with the reason when that fails.

        Mooncake reads its own environment (MC_TCP_BIND_ADDRESS, MC_LOG_LEVEL, MC_RPC_TIMEOUT_MS,
        MC_STORE_CLIENT_SETUP_RETRIES: without it a missing master is retried for ~90 s); set it before calling.
        """
        # Imported here so that importing kvsidecar never needs the native libraries.
        from kvsidecar.errors import NativeLibraryError
        from kvsidecar.store.native import ensure_native_libs

        try:
            ensure_native_libs()
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except (ImportError, NativeLibraryError) as exc:
            raise StoreUnavailable(f"cannot load the Mooncake client library: {exc}") from exc

        native = MooncakeDistributedStore()
        try:
            # What every setup prints (glog's notice, the new segment's missing descriptor) goes to the log; the rest
            # of Mooncake's output, errors included, to stderr as before.
            rc = quiet_setup(
                lambda: native.setup(
                    settings.local_hostname,
                    settings.metadata_server,
                    settings.global_segment_size,
                    settings.local_buffer_size,
                    settings.protocol,
                    settings.rdma_devices,
                    settings.master_server_addr,
                )
            )
        except (RuntimeError, TypeError) as exc:
            raise StoreUnavailable(f"Mooncake setup raised: {exc}") from exc
        if rc != SUCCESS:
            # A failed setup leaves an object whose close() is safe (measured) and releases its threads.
            native.close()
            raise StoreUnavailable(_setup_failure_reason(rc, settings))
        store = cls(native, settings, ReplicateConfig)
        if settings.global_segment_size:
            try:
                store._segment = locate_segment(store._call, settings.global_segment_size, ReplicateConfig)
            except (AttributeError, RuntimeError, OSError, StoreError) as exc:
                log.warning("could not locate the Mooncake segment (no pre-fault, no direct GPU copies): %s", exc)
        if settings.prefault_segment and store._segment is not None:
            store.prefault = SegmentPrefault(store._client, store._segment)
            store.prefault.start()
        return store

    @property
    def settings(self) -> MooncakeSettings:
        """The settings this client was set up with."""
        return self._settings

    @property
    def closed(self) -> bool:
        """Whether close() has been called."""
        with self._lifetime:
            return self._closed

    def _ensure_open(self) -> None:
        with self._lifetime:
            if self._closed:
                raise StoreUnavailable("the Mooncake store is closed")

    @contextmanager
    def _client(self) -> Iterator[Any]:
        """The native client, held open against close() for the duration of one call."""
        with self._lifetime:
            if self._closed:
                raise StoreUnavailable("the Mooncake store is closed")
            self._in_flight += 1
            native = self._native
        try:
            yield native
        finally:
            with self._lifetime:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._lifetime.notify_all()

    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        with self._client() as native:
            try:
                return fn(native)
            except RuntimeError as exc:
                raise StoreError(StoreCode.INTERNAL, f"{what} raised: {exc}") from exc

    def register_buffer(self, address: int, size: int) -> None:
        """Make [address, address+size) usable for zero-copy transfers (required for RDMA)."""
        rc = self._call("register_buffer", lambda n: n.register_buffer(address, size))
        if rc != SUCCESS:
            raise StoreError(from_mooncake(rc), f"register_buffer(0x{address:x}, {size}) returned {rc}")

    def unregister_buffer(self, address: int) -> None:
        """Undo register_buffer for the buffer starting at address."""
        rc = self._call("unregister_buffer", lambda n: n.unregister_buffer(address))
        if rc != SUCCESS:
            raise StoreError(from_mooncake(rc), f"unregister_buffer(0x{address:x}) returned {rc}")

    def exists(self, keys: Sequence[str]) -> list[Presence]:
        """One batch existence check; a failed check is UNKNOWN, never PRESENT."""
        if not keys:
            self._ensure_open()
            return []
        parts = min(_EXISTS_PARTS, len(keys) // _EXISTS_PART_KEYS)
        if parts > 1:
            # The master answers concurrent batches in parallel and the GIL is released meanwhile, so a check pays
            # for its keys about 1/parts of the time from about 2k keys on (2 cores: 2,048 keys 1.0 ms against 1.5
            # in one call, 13,104 keys 10.5 against 17): a prompt's stored part is checked at the speed a full
            # hit's is, so a lookup costs what is stored. The first part runs on this thread.
            step = -(-len(keys) // parts)
            chunks = [list(keys[i : i + step]) for i in range(step, len(keys), step)]
            try:
                futures = [self._exists_pool.submit(self._batch_is_exist, chunk) for chunk in chunks]
            except RuntimeError:  # the pool is shut down
                raise StoreUnavailable("the Mooncake store is closed") from None
            found = self._batch_is_exist(list(keys[:step]))
            for future in futures:
                found += future.result()
        else:
            found = self._batch_is_exist(list(keys))
        _check_result_length("batch_is_exist", found, keys)
        return presence_from_mooncake(found)

    def _batch_is_exist(self, keys: list[str]) -> list[int]:
        found: list[int] = self._call("batch_is_exist", lambda n: n.batch_is_exist(keys))
        return found

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        device: bool = False,
        pin: Pin | None = None,
    ) -> list[StoreCode]:
        """One batch put; an existing key keeps its old value and its pin, and reports OK (device buffers: the CUDA
        build reads them with cudaMemcpy, one per buffer)."""
        check_batch_shapes(keys, addresses, sizes)
        if not keys:
            self._ensure_open()
            return []
        config = self._replicate_config if pin is None else self._config(pin)
        codes = self._call(
            "batch_put_from_multi_buffers",
            lambda n: n.batch_put_from_multi_buffers(_list(keys), _lists(addresses), _lists(sizes), config),
        )
        _check_result_length("batch_put_from_multi_buffers", codes, keys)
        return [from_mooncake(code) for code in codes]

    def pin(
        self, keys: Sequence[str], sizes: Sequence[int], pin: Pin | None, *, hard_before: bool = False
    ) -> list[StoreCode]:
        """Each value read into scratch memory and written back with its new pin (store/pins.py says why)."""
        if len(sizes) != len(keys):
            raise StoreError(StoreCode.INVALID_PARAMS, f"{len(keys)} keys but {len(sizes)} sizes")
        if not keys:
            self._ensure_open()
            return []
        replace = hard_before or (pin is not None and pin.hard)
        config = self._config(pin, clear=not replace)
        return rewrite(self._call, self._scratch, list(keys), list(sizes), config, replace=replace)

    def _config(self, pin: Pin | None, *, clear: bool = False) -> Any:
        return replicate_config(self._config_type, self._settings.replica_num, pin, clear=clear)

    def get_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[StoreCode]:
        """One batch get; OK only when exactly sum(sizes) bytes were written for that key."""
        check_batch_shapes(keys, addresses, sizes)
        if not keys:
            self._ensure_open()
            return []
        return self._call("batch_get_into_multi_buffers", lambda n: _get_into(n, keys, addresses, sizes))

    def locate(self, keys: Sequence[str]) -> Iterator[Replica | None]:
        """Per key, its complete memory replica inside this client's own segment: one metadata call now (the master
        grants the read lease a get takes, so the replica is not evicted meanwhile), each key's descriptors read as
        the caller iterates (about 3 us a key of Python: the caller's copies run meanwhile)."""
        segment = self._segment
        if not keys or segment is None:
            self._ensure_open()
            return iter([None] * len(keys))
        found = self._call("batch_get_replica_desc", lambda n: n.batch_get_replica_desc(list(keys)))
        return _in_segment(found, keys, segment)

    def segment(self) -> Replica | None:
        """This client's own segment (located by a probe at connect), or None."""
        return self._segment

    def remove(self, keys: Sequence[str], *, force: bool = True) -> list[StoreCode]:
        """Batch remove; forced by default (a leased key goes too), since callers remove values known to be bad."""
        if not keys:
            self._ensure_open()
            return []
        codes = self._call("batch_remove", lambda n: n.batch_remove(list(keys), force))
        _check_result_length("batch_remove", codes, keys)
        return [from_mooncake(c) for c in codes]

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Remove every key that starts with prefix, leased or not; return how many were removed."""
        if not prefix:
            raise StoreError(StoreCode.INVALID_PARAMS, "an empty prefix would remove every key in the cluster")
        pattern = prefix_regex(prefix) + (f"({rest})$" if rest else "")
        removed = self._call("remove_by_regex", lambda n: n.remove_by_regex(pattern, True))
        code = from_mooncake(removed)
        if code is not StoreCode.OK:
            reason = f"remove_by_regex({pattern!r}) returned {removed}"
            if code in (StoreCode.RPC_FAILED, StoreCode.RPC_TIMEOUT):
                raise StoreUnavailable(f"master {self._settings.master_server_addr} unreachable: {reason}")
            raise StoreError(code, reason)
        return int(removed)

    def tiers(self, keys: Sequence[str]) -> list[str]:
        """Where each key is now: "memory", "disk" or "" (absent); one metadata call, no lease taken."""
        if not keys:
            return []
        found = self._call("batch_get_replica_desc", lambda n: n.batch_get_replica_desc(list(keys)))
        return [_tier(found.get(key, ())) for key in keys]

    def readable(self, key: str) -> bool:
        """Whether key's value can be read right now (into a scratch buffer): a check, not a data path."""
        size = self._call("get_size", lambda n: n.get_size(key))
        if size <= 0:
            return False
        scratch = ctypes.create_string_buffer(size)
        address = ctypes.addressof(scratch)
        self.register_buffer(address, size)
        try:
            read = self._call("get_into", lambda n: n.get_into(key, address, size))
        finally:
            self.unregister_buffer(address)
        return bool(read == size)

    def health(self) -> StoreHealth:
        """Whether the client is open and its master answers; never raises, a closed store is unhealthy."""
        health = self._health()
        return health._replace(detail=f"{health.detail}; {self._health_note}") if self._health_note else health

    def note_health(self, note: str) -> None:
        """A line health() adds to its detail from now on."""
        self._health_note = note

    def _health(self) -> StoreHealth:
        master = self._settings.master_server_addr
        try:
            rc = self._call("health_check", lambda n: n.health_check())
        except StoreError as exc:
            return StoreHealth(False, exc.reason)
        if rc == Health.HEALTHY:
            return StoreHealth(True, f"master {master} reachable")
        if rc == Health.MASTER_UNREACHABLE:
            return StoreHealth(False, f"master {master} unreachable")
        if rc == Health.NOT_INITIALIZED:
            return StoreHealth(False, "the Mooncake client is not initialized")
        return StoreHealth(False, f"health_check returned {rc}")

    def close(self) -> None:
        """Release the client once calls in flight have returned; later calls raise StoreUnavailable."""
        with self._lifetime:
            if self._closed:
                return
            self._closed = True
            # Native calls are bounded (see the module docstring), so this wait ends; closing under a running
            # call would crash the process.
            self._lifetime.wait_for(lambda: self._in_flight == 0)
            native, self._native = self._native, None
        self._exists_pool.shutdown(wait=False)
        native.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _list(items: Sequence[Any]) -> list[Any]:
    # The binding takes lists; the data path already hands over fresh ones, so copy only other sequences.
    return items if type(items) is list else list(items)


def _lists(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    return [row if type(row) is list else list(row) for row in rows]


def _get_into(
    native: Any, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
) -> list[StoreCode]:
    read = native.batch_get_into_multi_buffers(_list(keys), _lists(addresses), _lists(sizes))
    _check_result_length("batch_get_into_multi_buffers", read, keys)
    return [_get_outcome(native, key, count, sum(s)) for key, count, s in zip(keys, read, sizes, strict=True)]


def _get_outcome(native: Any, key: str, count: int, expected: int) -> StoreCode:
    if count == expected:
        return StoreCode.OK
    if count >= 0:
        return StoreCode.SIZE_MISMATCH
    code = from_mooncake(count)
    # Mooncake refuses a value that does not fit the buffers exactly, as -600 when they are too small and as -800
    # when too large; -800 is also a real transfer failure, so one size query on this rare path tells them apart
    # and the caller hears the same SIZE_MISMATCH the in-memory store reports.
    if code in (StoreCode.INVALID_PARAMS, StoreCode.TRANSFER_FAILED):
        size = native.get_size(key)
        if size >= 0 and size != expected:
            return StoreCode.SIZE_MISMATCH
    return code


def _in_segment(found: dict[str, Any], keys: Sequence[str], segment: Replica) -> Iterator[Replica | None]:
    """Each key's complete memory replica within segment, from batch_get_replica_desc's answer, else None."""
    low, high = segment.address, segment.address + segment.size
    for key in keys:
        here = None
        for r in found.get(key, ()):
            # The binding's calls are most of the walk's time: asking for the memory descriptor of a disk replica
            # raises instead of a kind check first (a third less time a key; the master answers with complete
            # replicas only, the status check is kept all the same: a replica still being written is never read).
            if int(r.status) != _COMPLETE:
                continue
            try:
                buffer = r.get_memory_descriptor().buffer_descriptor
            except RuntimeError:  # "Expected MemoryDescriptor": a disk replica
                continue
            address, size = buffer.buffer_address, buffer.size
            if low <= address and address + size <= high:
                here = Replica(address, size)
                break
        yield here


def _tier(replicas: Sequence[Any]) -> str:
    # A key with both replicas is served from memory, the copy Mooncake reads first.
    if any(r.is_memory_replica() for r in replicas):
        return "memory"
    return "disk" if any(r.is_disk_replica() or r.is_local_disk_replica() for r in replicas) else ""


def _check_result_length(what: str, results: Sequence[int], keys: Sequence[str]) -> None:
    if len(results) != len(keys):
        raise StoreError(StoreCode.INTERNAL, f"{what} returned {len(results)} results for {len(keys)} keys")


def _setup_failure_reason(rc: int, settings: MooncakeSettings) -> str:
    code = from_mooncake(rc)
    if code is StoreCode.INVALID_PARAMS:
        hint = "Mooncake rejected the settings"
    else:
        hint = f"is a mooncake_master listening at {settings.master_server_addr}?"
    return (
        f"Mooncake setup returned {rc} ({code.value}) for master {settings.master_server_addr}, "
        f"metadata {settings.metadata_server}, protocol {settings.protocol}, "
        f"segment {settings.global_segment_size} bytes: {hint}"
    )
