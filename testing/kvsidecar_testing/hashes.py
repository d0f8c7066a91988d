"""Block hashes of a prompt, chained as an engine chains them."""

from __future__ import annotations

import hashlib

__all__ = ["chained_hashes"]


def chained_hashes(salt: str, count: int) -> list[bytes]:
    """Hash i names the whole prefix [0, (i + 1) * U): prompts with the same salt share every hash they both reach."""
    out, prev = [], b""
    for i in range(count):
        prev = hashlib.sha256(prev + f"{salt}:{i}".encode()).digest()
        out.append(prev)
    return out
