"""Why one block was not saved or loaded: the one home of every failure reason a client sees and a metric labels.

The store's per-key outcomes (store/codes.py `StoreCode`) are one family of reasons; the daemon adds its own (a
tenant's write budget, a span the engine gave no block, bytes that fail their checksum). A reason's value is its
wire text and metric label.

Imports: store (its codes).
"""

from __future__ import annotations

import enum

from kvsidecar.store.codes import StoreCode

__all__ = ["Reason"]


class Reason(str, enum.Enum):
    """One block's failure reason."""

    # The store's, one for each StoreCode but OK.
    NOT_FOUND = "not_found"
    NO_SPACE = "no_space"
    EXISTS = "exists"
    LEASED = "leased"
    LEASE_EXPIRED = "lease_expired"
    TRANSFER_FAILED = "transfer_failed"
    RPC_FAILED = "rpc_failed"
    RPC_TIMEOUT = "rpc_timeout"
    SEGMENT_NOT_FOUND = "segment_not_found"
    INVALID_PARAMS = "invalid_params"
    SIZE_MISMATCH = "size_mismatch"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"
    # The daemon's own.
    TENANT_BUDGET = "tenant_budget"  # a save skipped by its tenant's write budget
    NO_BLOCK = "no_block"  # a load span the engine named no block for (NO_BLOCK): it recomputes it
    CHECKSUM_MISMATCH = "checksum_mismatch"  # a value read whose bytes fail its checksum: removed, recomputed

    @classmethod
    def of(cls, code: StoreCode) -> Reason:
        """The reason of a store outcome that is not OK."""
        if code is StoreCode.OK:
            raise ValueError("StoreCode.OK is no failure reason")
        return cls(code.value)

    def __str__(self) -> str:
        return self.value
