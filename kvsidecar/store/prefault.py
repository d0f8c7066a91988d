"""Pre-faulting a Mooncake client's own segment, so that puts never pay first-touch page faults.

A put into segment memory never written before takes a page fault per 4 KiB page (0.3-1.4 GiB/s per put measured
here, against 7-9 GiB/s into touched memory), and a segment stays that cold until it has filled once: hours, for a
large one. The daemon owns one long-lived segment per node, so it faults it in once, in the background, at start.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvsidecar.errors import StoreError
from kvsidecar.store.base import Replica, StoreUnavailable
from kvsidecar.store.codes import SUCCESS, StoreCode

__all__ = ["SegmentPrefault", "locate_segment", "writable_mapping_end"]

log = logging.getLogger(__name__)

MIB = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_CHUNK = 64 * MIB
_PROBE_KEY = "__kvsidecar_segment_probe__"
_PAGE = 4096
_PROBES = 3  # probe values put before the segment is called unknown


def locate_segment(
    call: Callable[[str, Callable[[Any], Any]], Any], segment_size: int, config_type: Any
) -> Replica | None:
    """Where a client's own segment lies in this process: (address, size), or None when that cannot be told.

    Mooncake does not say where it put the segment, so a small probe value is put into the client's own segment
    (preferred_segment = its hostname); in an empty segment it lands at the start, and the segment is the
    `segment_size` bytes from there, clipped to the mapping that holds the probe. `call(what, fn)` runs fn on the
    native client (raising StoreError).
    """
    hostname = call("get_hostname", lambda n: n.get_hostname())
    config = config_type()
    config.replica_num = 1
    config.preferred_segment = hostname
    landed: list[int] = []
    for _ in range(_PROBES):
        addresses = _probe(call, hostname, config)
        for address in addresses:
            end = writable_mapping_end(address)
            if end is not None:
                return Replica(address, min(end, address + segment_size) - address)
        landed += addresses
    # Mooncake takes preferred_segment as a preference: a probe may land in another client's segment.
    log.warning(
        "%d probes put into segment %s landed outside this process (at %s): its segment is not known (no pre-fault, "
        "no direct GPU copies)",
        _PROBES,
        hostname,
        ", ".join(f"{a:#x}" for a in landed) or "no memory replica",
    )
    return None


def _probe(call: Callable[[str, Callable[[Any], Any]], Any], hostname: str, config: Any) -> list[int]:
    """Addresses of the memory replicas of one small probe value put with `config` (then removed)."""
    key = f"{_PROBE_KEY}/{hostname}/{secrets.token_hex(8)}"
    if call("put", lambda n: n.put(key, bytes(64), config)) != SUCCESS:
        raise StoreError(StoreCode.INTERNAL, "the probe put failed")
    try:
        replicas = call("get_replica_desc", lambda n: n.get_replica_desc(key))
    finally:
        call("remove", lambda n: n.remove(key, True))
    return [int(r.get_memory_descriptor().buffer_descriptor.buffer_address) for r in replicas if r.is_memory_replica()]


class SegmentPrefault:
    """Faults a client's own segment in, chunk by chunk, in a background thread.

    MADV_POPULATE_WRITE fills in page tables as a write would, without writing: safe while puts and gets run. Best
    effort: a failure only logs. `hold()` keeps the client open for a block (raising StoreUnavailable once it is
    closed), so closing waits for at most one chunk.
    """

    def __init__(self, hold: Callable[[], AbstractContextManager[Any]], segment: Replica) -> None:
        self._hold = hold
        self._segment = segment
        self._thread = threading.Thread(target=self._run, name="kvsidecar-prefault", daemon=True)
        self.done = threading.Event()
        self.bytes = 0

    def start(self) -> None:
        """Begin in the background."""
        self._thread.start()

    def _run(self) -> None:
        try:
            self._populate(self._segment.address, self._segment.address + self._segment.size)
        except StoreUnavailable:
            pass  # closed meanwhile
        except OSError as exc:
            log.warning("could not pre-fault the Mooncake segment (puts will fault it in): %s", exc)
        finally:
            self.done.set()

    def _populate(self, start: int, end: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        began = time.monotonic()
        start -= start % _PAGE
        for offset in range(start, end, _CHUNK):
            size = min(_CHUNK, end - offset)
            with self._hold():
                rc = libc.madvise(offset, size, _MADV_POPULATE_WRITE)
            if rc != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")
            self.bytes += size
        log.info("pre-faulted %d MiB of the Mooncake segment in %.2f s", self.bytes // MIB, time.monotonic() - began)


def writable_mapping_end(address: int, maps: str = "/proc/self/maps") -> int | None:
    """End of the writable mapping of this process that holds address, or None."""
    with open(maps) as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return high if fields[1].startswith("rw") else None
    return None
