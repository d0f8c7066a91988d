"""One SGLang TP rank in a process of its own: its host pool, the backend as SGLang's factory builds it, and a job.

    python rank.py '{"socket": ..., "model": ..., "prefix": ..., "tp_rank": 0, "tp_size": 2, "job": "write"}'

write: fills its MHA and MLA pools (a seed per rank; MLA the same on every rank, as its latent is) and stores
PAGES pages of each, the MLA ones only where SGLang would (its is_storage_writer, rank 0); read: for each rank of
"tp_ranks", a fresh pool and backend of that rank load every page into other slots and check each byte against what
the writer of that rank held; truncate: saves and loads in a loop while its own pool is truncated under it. Prints
one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
from pools import PAGE, backend, extra_config, fill, host_pool

PAGES = 6
KEYS = [f"{0xA0 + i:064x}" for i in range(PAGES)]
WRITE_PAGES = [7, 2, 9, 4, 11, 5]  # pages in any order, as SGLang's host allocator hands them out
READ_PAGES = [20, 14, 25, 17, 30, 22]


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def page_bytes(pool: object, page: int) -> bytes:
    return bytes(pool.get_data_page(page * PAGE).view(torch.uint8).numpy())  # type: ignore[attr-defined]


def main(job: dict) -> dict:
    if job["job"] == "read":  # one fresh process may read as every rank (each a session of its own)
        return {str(rank): run({**job, "tp_rank": rank}) for rank in job["tp_ranks"]}
    return run(job)


def run(job: dict) -> dict:
    rank, size = job["tp_rank"], job["tp_size"]
    extra = extra_config(job["socket"], cache_prefix=job["prefix"], staging_pages=4)
    out: dict = {}
    for kind in ("mha", "mla"):
        mla = kind == "mla"
        seed = 1000 if mla else 1000 + rank  # the MLA latent is the same bytes on every rank
        pool = host_pool(kind, "page_first")
        storage = backend(pool, job["model"], extra, tp_rank=rank, tp_size=size, mla=mla)
        try:
            if job["job"] == "write":
                fill(pool, seed)
                # SGLang's controller skips the backup on ranks that are no storage writer (MLA: rank 0 only).
                writes = storage.batch_set_v1(KEYS, indices(WRITE_PAGES)) if not mla or rank == 0 else []
                out[kind] = {"set": writes}
            elif job["job"] == "read":
                expected = host_pool(kind, "page_first")
                fill(expected, seed)
                got = storage.batch_get_v1(KEYS, indices(READ_PAGES))
                pairs = zip(WRITE_PAGES, READ_PAGES, strict=True)
                exact = [page_bytes(pool, r) == page_bytes(expected, w) for w, r in pairs]
                out[kind] = {"get": got, "exact": exact, "exists": storage.batch_exists(KEYS)}
            else:
                fill(pool, seed)
                truncate = threading.Timer(0.5, os.ftruncate, (pool.fd, 0))
                truncate.start()
                while True:  # until SIGBUS: the pool is gone from under the backend's own copy
                    storage.batch_set_v1(KEYS, indices(WRITE_PAGES))
                    storage.batch_get_v1(KEYS, indices(READ_PAGES))
        finally:
            storage.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
