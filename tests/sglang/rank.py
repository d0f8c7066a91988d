"""A fresh process reading what SGLang TP ranks stored: for each rank of "tp_ranks", its own host pools and backend
(as SGLang's factory builds them) load every page into other slots and check each byte against what that rank's
writer held (`write_pages`, the same seeds). Prints one JSON line.

    python rank.py '{"socket": ..., "model": ..., "prefix": ..., "tp_size": 2, "tp_ranks": [0, 1]}'
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from pools import PAGE, backend, extra_config, fill, host_pool, page_bytes

PAGES = 6
KEYS = [f"{0xA0 + i:064x}" for i in range(PAGES)]
WRITE_PAGES = [7, 2, 9, 4, 11, 5]  # pages in any order, as SGLang's host allocator hands them out
READ_PAGES = [20, 14, 25, 17, 30, 22]
KINDS = ("mha", "mla")


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def seed(kind: str, rank: int) -> int:
    """The bytes a rank's pool holds: its own heads for MHA, the same latent on every rank for MLA."""
    return 1000 if kind == "mla" else 1000 + rank


def storage(job: dict[str, Any], kind: str, rank: int, **more: Any) -> tuple[Any, Any]:
    """A rank's host pool of `kind` and its backend."""
    extra = extra_config(job["socket"], cache_prefix=job["prefix"], **more)
    pool = host_pool(kind, "page_first")
    return pool, backend(pool, job["model"], extra, tp_rank=rank, tp_size=job["tp_size"], mla=kind == "mla")


def write_pages(job: dict[str, Any], rank: int) -> dict[str, list[bool]]:
    """What one rank's SGLang backs up: PAGES pages of each pool, the MLA ones only on its storage writer (rank 0)."""
    out = {}
    for kind in KINDS:
        pool, backend_ = storage(job, kind, rank)
        try:
            fill(pool, seed(kind, rank))
            # SGLang's controller skips the backup on ranks that are no storage writer (MLA: rank 0 only).
            writer = kind == "mha" or rank == 0
            out[kind] = backend_.batch_set_v1(KEYS, indices(WRITE_PAGES)) if writer else []
        finally:
            backend_.close()
    return out


def read_pages(job: dict[str, Any], rank: int) -> dict[str, Any]:
    out = {}
    for kind in KINDS:
        # Staged here, in place in the writers: the two paths read each other's values.
        pool, backend_ = storage(job, kind, rank, zero_copy=False)
        try:
            expected = host_pool(kind, "page_first")
            fill(expected, seed(kind, rank))
            got = backend_.batch_get_v1(KEYS, indices(READ_PAGES))
            pairs = zip(WRITE_PAGES, READ_PAGES, strict=True)
            exact = [page_bytes(pool, r) == page_bytes(expected, w) for w, r in pairs]
            out[kind] = {"get": got, "exact": exact, "exists": backend_.batch_exists(KEYS)}
        finally:
            backend_.close()
    return out


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps({str(r): read_pages(request, r) for r in request["tp_ranks"]}), flush=True)
