"""External hits land exactly where vLLM's own prefix-cache manager would put the hit for the same stored prefix.

For hybrid layouts with sliding windows, Mamba and groups of other block sizes: random stored sets go into the
store (real saves through a real daemon and mooncake_master) and, block for block, into a vLLM KVCacheManager's own
block pool; the real Scheduler's admission of a new request (with KVSidecarConnector) must start it at the length
vLLM's manager finds. Both sides resolve block sizes, hash block size and hit alignment with vLLM's own code.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from sidecar_engine import DTYPE, MAX_MODEL_LEN, Engine, kv_cache_config, vllm_config
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.request import Request, RequestStatus

from kvsidecar_contract.limits import NO_BLOCK

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TRIALS = 40  # random stored sets per layout


def full(block: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=DTYPE)


def sliding(block: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=DTYPE, sliding_window=window)


def mamba(block: int) -> MambaSpec:
    return MambaSpec(block_size=block, shapes=((3, 8),), dtypes=(DTYPE,), mamba_cache_mode="align")


# name -> (layer specs, prefix_match_unit); every one has a sliding window or blocks of several sizes.
LAYOUTS: dict[str, tuple[tuple[KVCacheSpec, ...], int | None]] = {
    # The case: a window on 32-token blocks turns vLLM's fine-grained hits off (alignment 64).
    "sliding32+mamba64@u16": ((sliding(32, 32), mamba(64)), 16),
    # A window on U-token blocks does not (alignment 16); W = 17 needs one block before the hit, not two.
    "full16+sliding17+mamba64": ((full(16), sliding(16, 17), mamba(64)), None),
    "full32+sliding48+mamba64@u16": ((full(32), sliding(32, 48), mamba(64)), 16),
    "full16+sliding33": ((full(16), sliding(16, 33)), None),
    "full16+mamba64": ((full(16), mamba(64)), None),
    "sliding16w24+full32": ((sliding(16, 24), full(32)), None),
}


def engine(model, daemon, prefix, specs, unit) -> Engine:
    recurrent = any(isinstance(s, MambaSpec) for s in specs)
    config = vllm_config(
        model, {"socket": daemon.target, "cache_prefix": prefix}, recurrent=recurrent, prefix_match_unit=unit
    )
    return Engine.start(config, kv_cache_config(specs, num_blocks=512), resolve=True)


def reference(eng: Engine) -> KVCacheManager:
    """vLLM's own prefix-cache manager for the same KV-cache config, block sizes and hash block size."""
    return KVCacheManager(
        kv_cache_config=eng.kv,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=eng.scheduler.block_size,
        hash_block_size=eng.scheduler.hash_block_size,
        enable_caching=True,
    )


def boundaries(eng: Engine, num_tokens: int) -> list[int]:
    """Every hash boundary of a prompt: a stored set may hold any of them (a save stores a recurrent state or a
    partial block at the prompt's last one); each manager must use only those it can serve a hit from."""
    u = eng.scheduler.hash_block_size
    return list(range(u, num_tokens // u * u + 1, u))


def store(eng: Engine, hashes: list[bytes], stored: list[list[int]]) -> None:
    """Save the stored boundaries through the engine's rank session: one Save per boundary, every other span
    NO_BLOCK (skipped by the daemon, which also skips a partial block no hit could end in)."""
    client = eng.worker.client
    u = eng.scheduler.hash_block_size
    specs = [g.kv_cache_spec for g in eng.kv.kv_cache_groups]
    for b in sorted({b for row in stored for b in row}):
        ids = []
        for gid, spec in enumerate(specs):
            index = (b - 1) // spec.block_size
            row = [NO_BLOCK] * (index + 1)
            if b in stored[gid]:
                row[index] = 1 + (7 * gid + index) % 500
            ids.append(row)
        result = client.save(hashes[: b // u], ids, b, saved_tokens=b - u).result(timeout=30)
        assert result.failed == 0, result


def vllm_hit(manager: KVCacheManager, eng: Engine, prompt: list[int], stored: list[list[int]]) -> int:
    """The hit vLLM's own manager finds with the stored boundaries as cached blocks of its block pool."""
    request = new_request(eng, "ref", prompt)
    pool = manager.block_pool
    u = eng.scheduler.hash_block_size
    for gid, row in enumerate(stored):
        for b in row:
            block = KVCacheBlock(block_id=1 + (7 * gid + b) % 500)
            pool.cached_block_hash_to_block.insert(
                make_block_hash_with_group_id(request.block_hashes[b // u - 1], gid), block
            )
    return manager.get_computed_blocks(request)[1]


def new_request(eng: Engine, req_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=eng.block_hasher,
    )


def scheduler_start(eng: Engine, req_id: str) -> int:
    """Tokens the real Scheduler admits the request with: the external hit (its own cache holds nothing)."""
    output = eng.step()
    new = [n for n in output.scheduled_new_reqs if n.req_id == req_id]
    request = eng.request(req_id)
    if new:
        return new[0].num_computed_tokens
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request.status
    return request.num_computed_tokens


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_external_hits_equal_vllms_own(vllm_env, tiny_model, daemon, cache_prefix, layout):
    specs, unit = LAYOUTS[layout]
    rng = random.Random(f"alignment/{layout}")
    eng = engine(tiny_model, daemon, cache_prefix, specs, unit)
    try:
        manager = reference(eng)
        info = eng.connector.client.session_info
        assert info is not None
        # The session took vLLM's alignment, not one of its own.
        assert info.hit_alignment_tokens == eng.kv.cache_hit_alignment_tokens
        assert info.fine_grained_hits == (eng.kv.cache_hit_alignment_tokens < eng.scheduler.block_size)
        hits, mismatches = [], []
        for trial in range(TRIALS):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 400))]
            hashes = [bytes(h) for h in new_request(eng, "hashes", prompt).block_hashes]
            keep = rng.choice([0.5, 0.8, 0.95, 1.0])
            stored = [
                [b for b in boundaries(eng, len(prompt)) if rng.random() < keep]
                for gid in range(len(eng.kv.kv_cache_groups))
            ]
            store(eng, hashes, stored)
            want = vllm_hit(manager, eng, prompt, stored)
            req_id = f"{layout}/{trial}"
            eng.add(req_id, prompt, max_tokens=1, look_up=True)
            got = scheduler_start(eng, req_id)
            eng.run_until(req_id)
            hits.append(want)
            if got != want:
                mismatches.append((trial, len(prompt), stored, got, want))
        assert not mismatches, f"{len(mismatches)} of {TRIALS} hits differ from vLLM's: {mismatches[:3]}"
        assert sum(1 for h in hits if h) >= TRIALS // 4, f"too few non-zero hits to say anything: {hits}"
    finally:
        eng.close()
