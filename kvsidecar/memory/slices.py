"""Where a stored value's slices lie in a session's mappings, and host memory as a tensor, for the movers that copy
whole batches at once (kvsidecar/movers) rather than one address at a time."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SliceTemplate", "host_bytes", "host_tensor"]


@dataclass(frozen=True, slots=True)
class SliceTemplate:
    """Where one slice of every block lies: block b's slice is [offset + b * stride, + length) of the mapping."""

    mapping: str  # the mapping's key in SessionMemory.mappings
    offset: int
    stride: int
    length: int


def host_tensor(address: int, size: int) -> torch.Tensor:
    """[address, address + size) of this process's memory as a 1-D uint8 CPU tensor, without a copy.

    The tensor does not keep the memory mapped: it must be dropped before whoever owns the memory unmaps it."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


def host_bytes(address: int, size: int) -> memoryview:
    """[address, address + size) of this process's memory as a memoryview of bytes, without a copy (what a checksum
    reads); like host_tensor, it must be dropped before whoever owns the memory unmaps it."""
    return memoryview((ctypes.c_uint8 * size).from_address(address))
