"""Checksums on the data path: a chosen value's trailer (trailer.py) sealed at save from the bytes put, and checked
at load before the load answers; a value that fails is removed from the store and reported CHECKSUM_MISMATCH, so the
engine recomputes it (and its next save writes it again), never served.

The movers hand over each value's bytes where the CPU reads them: the engine's blocks (host memory); the segment
replicas and the bounce a device load copies from; the bounce a device save copies its chosen values into. Sums run
on the calling data-path thread, and a large batch's on a few threads of the Sums' own as well (xxhash releases the
GIL while it hashes, so they run on as many cores).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from kvsidecar.errors import StoreError
from kvsidecar.metrics import Metrics
from kvsidecar.movers.trailer import TRAILER_BYTES, ChecksumSettings, chosen, digest, sealed, verdict
from kvsidecar.reasons import Reason
from kvsidecar.store import Store, StoreCode

__all__ = ["Loaded", "Sums", "Trailers"]

log = logging.getLogger(__name__)

Loaded = StoreCode | Reason  # one value's load: the store's code, or the daemon's verdict on bytes the store read
Parts = Sequence[memoryview]  # one value's bytes, in order

_SMALLEST = 64  # trailers in the smallest buffer (1 KiB); buffers come in powers of two of this
PARALLEL_BYTES = 8 << 20  # a batch summing at least this much is split across the Sums' threads
_THREADS = max(1, min(4, os.cpu_count() or 1))


class Trailers:
    """Host memory for the trailers of one store call's values, one after the other, registered with the store."""

    def __init__(self, capacity: int) -> None:
        self._buffer = (ctypes.c_uint8 * (capacity * TRAILER_BYTES))()
        self.base = ctypes.addressof(self._buffer)
        self.capacity = capacity
        self.view = memoryview(self._buffer)
        self.registered = False

    def address(self, i: int) -> int:
        """Where value i's trailer lies."""
        return self.base + i * TRAILER_BYTES

    def trailer(self, i: int) -> memoryview:
        """Value i's trailer, as the store wrote it."""
        return self.view[i * TRAILER_BYTES : (i + 1) * TRAILER_BYTES]

    def clear(self, n: int) -> None:
        """Zero the first n trailers (before a get: a trailer the store did not write is never taken for one)."""
        ctypes.memset(self.base, 0, n * TRAILER_BYTES)

    def write(self, trailers: Sequence[bytes], first: int = 0) -> None:
        """The trailers of values first, first + 1, ... in place."""
        blob = b"".join(trailers)
        if first + len(trailers) > self.capacity:
            raise ValueError(f"trailers {first}..{first + len(trailers)} of a buffer of {self.capacity}")
        ctypes.memmove(self.address(first), blob, len(blob))


class Sums:
    """Seals chosen values at save and checks them at load, by the rule of a daemon's --checksums; one per daemon,
    shared by the movers of every session (its trailer memory is registered with the store once and reused)."""

    def __init__(self, settings: ChecksumSettings, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.checksum_every = settings.checksum_every
        self._store = store
        self._metrics = metrics
        self._lock = threading.Lock()
        self._free: dict[int, list[Trailers]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._none = Trailers(0)

    def close(self) -> None:
        """Unregister the trailer memory from the store and let it go (the daemon's sessions are all closed: no call
        is using it); later calls take fresh memory."""
        with self._lock:
            free, self._free = self._free, {}
            pool, self._pool = self._pool, None
        for buffers in free.values():
            for buffer in buffers:
                if buffer.registered:
                    try:
                        self._store.unregister_buffer(buffer.base)
                    except StoreError as exc:
                        log.debug("could not unregister trailer memory from the store: %s", exc)
        if pool is not None:
            pool.shutdown(wait=False)

    @contextmanager
    def trailers(self, n: int) -> Iterator[Trailers]:
        """Trailer memory for n values, for one store call; reused by later calls once it is given back."""
        if n == 0:
            yield self._none
            return
        capacity = _SMALLEST
        while capacity < n:
            capacity *= 2
        with self._lock:
            free = self._free.setdefault(capacity, [])
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = Trailers(capacity)
            try:
                # Required by RDMA transports only: over TCP the store reads and writes any memory.
                self._store.register_buffer(buffer.base, capacity * TRAILER_BYTES)
                buffer.registered = True
            except StoreError as exc:
                log.warning("could not register trailer memory with the store (RDMA transfers of it fail): %s", exc)
        try:
            yield buffer
        finally:
            with self._lock:
                self._free.setdefault(capacity, []).append(buffer)

    def chosen(self, keys: Sequence[str]) -> list[bool]:
        """Which of these keys' values carry a trailer."""
        every = self.checksum_every
        if every == 0:
            return [False] * len(keys)
        return [chosen(key, every) for key in keys]

    def members(self, keys: Sequence[str]) -> list[int]:
        """The indices of the keys whose values carry a trailer, in order (none at once when checksums are off)."""
        every = self.checksum_every
        if every == 0:
            return []
        return [i for i, key in enumerate(keys) if chosen(key, every)]

    def seal(self, keys: Sequence[str], value: Callable[[int], Parts], sizes: Sequence[int]) -> list[bytes]:
        """The trailer of every value i of keys, its sum over value(i)."""
        totals = self._each(lambda i: digest(keys[i], value(i)), list(range(len(keys))), sizes)
        if keys:
            self._metrics.checksums.labels("summed").inc(len(keys))
        return [sealed(total) for total in totals]

    def check(
        self,
        keys: Sequence[str],
        codes: Sequence[Loaded],
        trailer: Callable[[int], memoryview],
        value: Callable[[int], Parts],
        sizes: Sequence[int],
    ) -> list[Loaded]:
        """codes, with CHECKSUM_MISMATCH for every value i read (OK) whose trailer(i) does not hold the sum of
        value(i); those values are removed from the store."""
        out = list(codes)
        ok = [i for i, code in enumerate(codes) if code is StoreCode.OK]
        if not ok:
            return out
        totals = self._each(lambda i: digest(keys[i], value(i)), ok, sizes)
        bad = [i for i, total in zip(ok, totals, strict=True) if not verdict(trailer(i), total)]
        self._metrics.checksums.labels("verified").inc(len(ok))
        if bad:
            for i in bad:
                out[i] = Reason.CHECKSUM_MISMATCH
            self._metrics.checksums.labels("mismatch").inc(len(bad))
            self._discard([keys[i] for i in bad])
        return out

    def _discard(self, keys: list[str]) -> None:
        """Remove values whose bytes failed: the engine's recompute saves them again (a put never replaces)."""
        try:
            self._store.remove(keys)
        except StoreError as exc:
            self._metrics.store_errors.labels("remove", exc.code.value).inc()

    def _each(self, fn: Callable[[int], int], todo: list[int], sizes: Sequence[int]) -> list[int]:
        """fn of every index in todo, in order: on this thread, and for a large batch on the pool's threads too."""
        if _THREADS == 1 or len(todo) < 2 or sum(sizes[i] for i in todo) < PARALLEL_BYTES:
            return [fn(i) for i in todo]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_THREADS - 1, thread_name_prefix="kvsidecar-sums")
            pool = self._pool
        step = -(-len(todo) // _THREADS)
        parts = [todo[k : k + step] for k in range(0, len(todo), step)]
        futures = [pool.submit(lambda part: [fn(i) for i in part], part) for part in parts[1:]]
        out = [fn(i) for i in parts[0]]
        for future in futures:
            out += future.result()
        return out
