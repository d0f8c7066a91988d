"""The wire contract's limits and markers: one definition that the daemon and the client both import."""

from __future__ import annotations

__all__ = [
    "MAX_BATCH_ITEMS",
    "MAX_BLOCK_IDS",
    "MAX_GROUPS",
    "MAX_HASHES",
    "MAX_HASH_BYTES",
    "MAX_MEMFDS",
    "MAX_MODEL_CHARS",
    "MAX_NAME_CHARS",
    "MAX_REGIONS",
    "NO_BLOCK",
]

NO_BLOCK = 0xFFFF_FFFF  # a block id meaning "no block for this span" (vLLM's null block): saves skip it, loads fail it
MAX_GROUPS = 64  # KV-cache groups per session
MAX_REGIONS = 4096  # memory regions per session
MAX_MEMFDS = 253  # memfds per session, in one SCM_RIGHTS message (Linux SCM_MAX_FD); regions may share one
MAX_HASHES = 1 << 20  # block hashes per request
MAX_BLOCK_IDS = 1 << 20  # block ids per request, all groups together
# Requests per SaveBatch/LoadBatch (an engine step: vLLM schedules at most max_num_seqs, 1024 at most in practice);
# MAX_HASHES and MAX_BLOCK_IDS bound a batch's items together, so a batch costs no more than one big request.
MAX_BATCH_ITEMS = 4096
MAX_HASH_BYTES = 64  # bytes of one block hash
MAX_MODEL_CHARS = 1024  # characters of a model name
MAX_NAME_CHARS = 256  # characters of a cache prefix or client name
