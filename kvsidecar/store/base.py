"""The store interface the daemon depends on, whole: Mooncake and the in-memory test store implement all of it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from kvsidecar.errors import StoreError
from kvsidecar.store.codes import Presence, StoreCode

__all__ = ["Pin", "Presence", "Replica", "Store", "StoreHealth", "StoreUnavailable", "check_batch_shapes"]


class StoreUnavailable(StoreError):
    """The store cannot be reached (closed, master down, setup failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(StoreCode.UNAVAILABLE, reason)


class StoreHealth(NamedTuple):
    """What an operator needs to know about the store connection."""

    healthy: bool
    detail: str


class Replica(NamedTuple):
    """Where a value's bytes lie in this process's own segment memory."""

    address: int
    size: int


class Pin(NamedTuple):
    """How the store keeps a value ahead of ordinary cache: a soft pin for ttl_ms from when the value is written
    (evicted only when ordinary values cannot make room, and ordinary again after its time), or a hard pin (never
    evicted, until the value is made ordinary again). Where a pin is asked for, None is ordinary cache."""

    ttl_ms: int = 0
    hard: bool = False


class Store(Protocol):
    """A batch key-value store that moves bytes straight to and from registered memory.

    A value is a list of buffers (address, size) concatenated; ``put_from`` and ``get_into`` take, per key, the
    addresses and sizes of its buffers. Every method returns one result per key, in order, and raises only
    ``StoreError`` (``StoreUnavailable`` when the store cannot be reached at all).
    """

    def register_buffer(self, address: int, size: int) -> None:
        """Make [address, address+size) usable for zero-copy transfers (required for RDMA)."""

    def unregister_buffer(self, address: int) -> None:
        """Undo register_buffer for the buffer starting at address."""

    def exists(self, keys: Sequence[str]) -> list[Presence]:
        """One batch existence check."""
        ...

    def put_from(
        self,
        keys: Sequence[str],
        addresses: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        device: bool = False,
        pin: Pin | None = None,
    ) -> list[StoreCode]:
        """One batch put; an existing key keeps its old value (and its pin: see `pin`) and reports OK.

        device: the buffers are GPU memory (the device path's staging), which Mooncake's CUDA build reads itself;
        what must read the bytes on the CPU (the disk tier's write-behind) takes them from the stored replica.
        pin: the new values are kept ahead of ordinary cache so (None: ordinary cache).
        """
        ...

    def pin(
        self, keys: Sequence[str], sizes: Sequence[int], pin: Pin | None, *, hard_before: bool = False
    ) -> list[StoreCode]:
        """Give stored values of these sizes another pin, keeping their bytes: a soft pin's time starts again from
        now, None makes them ordinary cache; hard_before: they are hard-pinned now. NOT_FOUND for a value no longer
        there; a value another writer replaced meanwhile may be re-written with the bytes read here."""
        ...

    def get_into(
        self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[StoreCode]:
        """One batch get; OK only when exactly sum(sizes) bytes were written for that key."""
        ...

    def locate(self, keys: Sequence[str]) -> Iterable[Replica | None]:
        """Per key in order, its value's complete replica in this process's own segment memory, read-leased as a get
        is (the master's lease time, taken by the call), for the device mover to copy itself; None where it is not
        there (absent, on another node, only on disk). What is read per key may be read as the caller iterates, so
        that its copies start before the last key is known."""
        ...

    def segment(self) -> Replica | None:
        """This process's own segment memory, where `locate` finds replicas (None: it has none, or not yet known)."""
        ...

    def remove(self, keys: Sequence[str], *, force: bool = True) -> list[StoreCode]:
        """Remove these keys, by default even if leased (a value that must not be served); one result per key."""
        ...

    def remove_prefix(self, prefix: str, rest: str = "") -> int:
        """Remove every key that starts with prefix (and, if rest is given, continues with a full match of the
        regular expression rest); return how many were removed."""
        ...

    def tiers(self, keys: Sequence[str]) -> list[str]:
        """Where each key is now: "memory", "disk" or "" (absent); a metadata call that takes no lease."""
        ...

    def readable(self, key: str) -> bool:
        """Whether key's value can be read right now (into a scratch buffer): a check, not a data path."""
        ...

    def health(self) -> StoreHealth:
        """Whether the store and its master answer, with the last note_health text after the detail."""
        ...

    def note_health(self, note: str) -> None:
        """A line health() adds to its detail from now on (the disk tier's recovery at start); empty: none."""

    def close(self) -> None:
        """Release the store; later calls raise StoreUnavailable instead of crashing."""


def check_batch_shapes(keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> None:
    """Raise StoreError(INVALID_PARAMS) unless there is one address list and one size list per key, of equal length."""
    if len(addresses) != len(keys) or len(sizes) != len(keys):
        raise StoreError(
            StoreCode.INVALID_PARAMS,
            f"{len(keys)} keys but {len(addresses)} address lists and {len(sizes)} size lists",
        )
    for key, key_addresses, key_sizes in zip(keys, addresses, sizes, strict=True):
        if len(key_addresses) != len(key_sizes):
            raise StoreError(
                StoreCode.INVALID_PARAMS, f"key {key!r} has {len(key_addresses)} addresses but {len(key_sizes)} sizes"
            )
