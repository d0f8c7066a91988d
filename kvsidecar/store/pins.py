"""Mooncake's pins: the ReplicateConfig of a Pin, and giving stored values another pin without their writer.

What Mooncake 0.3.13.post1 does (source read, and measured against its master: docs/retention.md):

- A put with `soft_pin_action = ENABLE` and `soft_pin_ttl_ms` soft-pins a new value until that long after it becomes
  readable; eviction takes ordinary values first (least recently leased) and soft-pinned ones only when those cannot
  make room (`--allow_evict_soft_pinned_objects`, default true). A read never extends a pin.
- A put on an existing key keeps its value and its pin, whatever the config says. `upsert` with ENABLE (or DISABLE)
  rewrites the value in place and sets (or clears) its soft pin; the time starts again at the upsert's end.
- A hard pin (`with_hard_pin`) is set only by the put that creates a value, and no upsert clears it: changing it
  takes a remove and a put.
- A soft TTL above the master's `--max_kv_soft_pin_ttl`, or a TTL with any action but ENABLE, is refused with -600.

So a stored value's pin changes here by reading it into a scratch buffer of the daemon's own and writing it back:
an upsert for a soft pin or none, a forced remove and a put where a hard pin is set or taken away. The scratch buffer
is made and registered once (16 MiB; a bigger value gets one of its own for its batch): making a fresh one per call
cost 0.2-1.1 s per 64 MiB here, where the read and the upsert take 20-60 ms.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvsidecar.store.base import Pin
from kvsidecar.store.codes import StoreCode, from_mooncake

__all__ = ["SCRATCH_BYTES", "Scratch", "replicate_config", "rewrite"]

# Values rewritten per batch are read into one scratch buffer of this many bytes (a bigger value alone).
SCRATCH_BYTES = 16 << 20

Call = Callable[[str, Callable[[Any], Any]], Any]  # a store's guarded call: (what, fn(native)) -> its result


class Scratch:
    """The daemon's buffer values are read into to be written back: made and registered at first use, then kept;
    one rewrite at a time."""

    def __init__(self, size: int = SCRATCH_BYTES) -> None:
        self.size = size
        self.lock = threading.Lock()
        self._buffer: ctypes.Array[ctypes.c_char] | None = None

    def address(self, call: Call) -> int:
        """The buffer's address, registered with the store (call with the lock held)."""
        if self._buffer is None:
            buffer = ctypes.create_string_buffer(self.size)
            call("register_buffer", lambda n: n.register_buffer(ctypes.addressof(buffer), self.size))
            self._buffer = buffer
        return ctypes.addressof(self._buffer)


def replicate_config(config_type: Any, replica_num: int, pin: Pin | None, *, clear: bool = False) -> Any:
    """A ReplicateConfig for puts with pin (None: ordinary; clear: also take a soft pin away, for an upsert)."""
    from mooncake.store import SoftPinAction

    config = config_type()
    config.replica_num = replica_num
    if pin is not None and pin.hard:
        config.with_hard_pin = True
    elif pin is not None:
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = pin.ttl_ms
    elif clear:
        config.soft_pin_action = SoftPinAction.DISABLE
    return config


def rewrite(
    call: Call, scratch: Scratch, keys: Sequence[str], sizes: Sequence[int], config: Any, *, replace: bool
) -> list[StoreCode]:
    """Read each value into scratch memory and write it back under config: upserted in place, or (replace) removed
    and put again. One code per key: what the read failed with, else what the write did."""
    out: list[StoreCode] = [StoreCode.OK] * len(keys)
    with scratch.lock:
        for batch in _batches(sizes, scratch.size):
            keys_, sizes_ = [keys[j] for j in batch], [sizes[j] for j in batch]
            if sum(sizes_) <= scratch.size:
                _rewrite_batch(call, scratch.address(call), keys_, sizes_, config, replace, batch, out)
                continue
            _rewrite_alone(call, keys_, sizes_, config, replace, batch, out)
    return out


def _rewrite_alone(
    call: Call, keys: list[str], sizes: list[int], config: Any, replace: bool, where: list[int], out: list[StoreCode]
) -> None:
    """A value larger than the scratch buffer, through a buffer of its own."""
    big = ctypes.create_string_buffer(sum(sizes))
    base = ctypes.addressof(big)
    call("register_buffer", lambda n: n.register_buffer(base, ctypes.sizeof(big)))
    try:
        _rewrite_batch(call, base, keys, sizes, config, replace, where, out)
    finally:
        call("unregister_buffer", lambda n: n.unregister_buffer(base))


def _rewrite_batch(
    call: Call,
    base: int,
    keys: list[str],
    sizes: list[int],
    config: Any,
    replace: bool,
    where: list[int],
    out: list[StoreCode],
) -> None:
    ptrs, offset = [], 0
    for size in sizes:
        ptrs.append(base + offset)
        offset += size
    read = call("batch_get_into", lambda n: n.batch_get_into(keys, ptrs, sizes))
    whole = [i for i, (got, size) in enumerate(zip(read, sizes, strict=True)) if got == size]
    for i, got in enumerate(read):
        if got != sizes[i]:
            out[where[i]] = from_mooncake(got) if got < 0 else StoreCode.SIZE_MISMATCH
    if not whole:
        return
    wkeys, wptrs, wsizes = [keys[i] for i in whole], [ptrs[i] for i in whole], [sizes[i] for i in whole]
    if replace:
        call("batch_remove", lambda n: n.batch_remove(wkeys, True))
        codes = call("batch_put_from", lambda n: n.batch_put_from(wkeys, wptrs, wsizes, config))
    else:
        codes = call("batch_upsert_from", lambda n: n.batch_upsert_from(wkeys, wptrs, wsizes, config))
    for i, code in zip(whole, codes, strict=True):
        out[where[i]] = from_mooncake(code)


def _batches(sizes: Sequence[int], most: int) -> Iterator[list[int]]:
    batch: list[int] = []
    total = 0
    for j, size in enumerate(sizes):
        if batch and total + size > most:
            yield batch
            batch, total = [], 0
        batch.append(j)
        total += size
    if batch:
        yield batch
