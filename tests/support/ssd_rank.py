"""One engine rank as its own process for the disk-tier tests: saves prompts until stored, or reads them all back.

    python -m support.ssd_rank TARGET TP RANK PROMPTS save|verify

Prints one JSON line: for save {"written", "no_space_retries", "bytes"}; for verify {"exact", "missing", "wrong"}
(missing: not found or not loaded; wrong: loaded with other bytes, which must never happen).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterable

from kvsidecar_contract.placement import Geometry, GroupSpec, Kind, Layout, Parallel, compute_hit, lookup_plan
from support.rawrank import RawRank, group, open_request

BLOCK = 256 << 10
BLOCKS_PER_PROMPT = 4
TOKENS = 16 * BLOCKS_PER_PROMPT
MODEL = "org/Hybrid-SSD"
SAVE_DEADLINE_S = 150.0


def prompt_hashes(p: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(BLOCKS_PER_PROMPT):
        prev = hashlib.sha256(prev + f"prompt{p}:{i}".encode()).digest()
        out.append(prev)
    return out


def layout(tp: int) -> Layout:
    """The placement layout of the session main() opens, for computing its keys outside the daemon."""
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16))
    return Layout(MODEL, groups, Parallel(tp_size=tp), num_kv_heads=tp, hash_block_size=16)


def servable_prompts(stored: Iterable[str], tp: int, prompts: int) -> int:
    """How many of the first `prompts` prompts a lookup finds whole when only the keys `stored` exist.

    Uses the daemon's own lookup rules: a boundary counts only when every TP rank's namespace holds it (rule 7),
    so a prompt comes back only when all ranks' blocks it needs are stored.
    """
    have = set(stored)
    geo = Geometry.of(layout(tp))
    whole = 0
    for p in range(prompts):
        plan = lookup_plan(geo, prompt_hashes(p), TOKENS + 1)
        hit = compute_hit(geo, TOKENS + 1, plan.stored([k in have for k in plan.keys]))
        whole += hit.hit_tokens == TOKENS
    return whole


def pattern(tag: str) -> bytes:
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def fill(rank: RawRank, r: int, p: int) -> None:
    for g in range(2):
        for b in range(BLOCKS_PER_PROMPT):
            rank.fill_block(g, b, pattern(f"r{r}/p{p}/g{g}/b{b}"))


def save(rank: RawRank, r: int, prompts: int) -> dict[str, int]:
    retries = written = nbytes = 0
    deadline = time.monotonic() + SAVE_DEADLINE_S
    ids = [list(range(BLOCKS_PER_PROMPT))] * 2
    for p in range(prompts):
        fill(rank, r, p)
        while True:
            reply = rank.save(prompt_hashes(p), ids, TOKENS)
            written += reply.written
            nbytes += reply.bytes_written
            if not reply.failed:
                break
            # A full DRAM tier fails soft with no_space while blocks are offloaded; the rank tries again later.
            assert {f.reason for f in reply.failures} == {"no_space"}, reply
            assert time.monotonic() < deadline, f"prompt {p} not stored in {SAVE_DEADLINE_S} s"
            retries += 1
            time.sleep(0.25)
    return {"written": written, "no_space_retries": retries, "bytes": nbytes}


def verify(rank: RawRank, r: int, prompts: int) -> dict[str, object]:
    exact, missing, wrong = 0, [], []
    dest = [list(range(BLOCKS_PER_PROMPT, 2 * BLOCKS_PER_PROMPT))] * 2
    for p in range(prompts):
        h = prompt_hashes(p)
        hit = rank.lookup(h, TOKENS + 1)
        if hit.hit_tokens != TOKENS:
            missing.append((p, f"hit {hit.hit_tokens}"))
            continue
        loaded = rank.load(h, dest, hit)
        if loaded.failures:
            missing.append((p, sorted({f.reason for f in loaded.failures})))
            continue
        blocks = [rank.block(0, BLOCKS_PER_PROMPT + b) for b in range(BLOCKS_PER_PROMPT)]
        want = [pattern(f"r{r}/p{p}/g0/b{b}") for b in range(BLOCKS_PER_PROMPT)]
        state_ok = rank.block(1, 2 * BLOCKS_PER_PROMPT - 1) == pattern(f"r{r}/p{p}/g1/b{BLOCKS_PER_PROMPT - 1}")
        if blocks == want and state_ok:
            exact += 1
        else:
            wrong.append(p)
    return {"exact": exact, "missing": missing, "wrong": wrong}


def main() -> None:
    target, tp, r, prompts, what = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    # Full attention with one KV head per rank (each rank its own bytes) and a Mamba state: a hybrid model.
    request = open_request([group("full_attention", 16), group("mamba", 16)], tp=tp, rank=r, heads=tp, model=MODEL)
    rank = RawRank(target, request, num_blocks=2 * BLOCKS_PER_PROMPT, block_bytes=BLOCK)
    try:
        rank.register()
        result = save(rank, r, prompts) if what == "save" else verify(rank, r, prompts)
    finally:
        rank.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
