"""kvsidecar's keys can never equal a key of vLLM 0.33's in-tree Mooncake store connector (docs/vllm.md).

No shared-store mode exists: the in-tree connector's values differ from ours for Mamba, hybrids and uniform groups
(the same key would hold other bytes), so the two must never meet under one key. The in-tree keys here come from
vLLM's own key code (`PoolKey`, the rank-local and TP-sharded store layouts, its Mooncake group ids), including
names chosen to look like ours; ours come from the contract's placement core for the same names and prefixes.
"""

from __future__ import annotations

import itertools
import re

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed: run scripts/setup-vllm.sh and use .venv-vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as intree_worker
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    LBHNCStoreLayout,
    LBNHCStoreLayout,
    PoolKey,
    RankLocalStoreLayout,
)

from kvsidecar_contract.placement import (
    KEY_TAIL_PATTERN,
    Geometry,
    GroupSpec,
    Kind,
    Layout,
    Parallel,
    key_prefix,
    lookup_plan,
    save_plan,
)

HASHES = [bytes([i]) * 32 for i in range(1, 4)]
OURS_LIKE = Layout("m", (GroupSpec(Kind.FULL_ATTENTION, 16),)).model_key
# Names an in-tree deployment might use, some built to imitate our fields.
MODELS = ["tiny-llama", "m", "kvs1", OURS_LIKE, f"@@{OURS_LIKE}@s0.c0.d0.p0.g0", "s0.c0.d0.p0.g0", "a@b"]
PREFIXES = ["", "t", "kvs1", "kvs1@", f"kvs1@t@{OURS_LIKE}", "s0.c0.d0.p0.g0@"]
NAMESPACES = ["", "@store_pp:1@store_format:rank_local_tp2_layout_LBNHC", "@store_pp:2@store_format:tp_shared_mqa"]


def intree_keys() -> set[str]:
    keys: set[str] = set()
    for model, prefix, namespace in itertools.product(MODELS, PREFIXES, NAMESPACES):
        for tp, pcp, dcp, pp, group in itertools.product(range(4), range(2), range(2), range(2), range(3)):
            meta = KeyMetadata(model, tp, pcp, dcp, pp, group, cache_prefix=prefix, store_namespace=namespace)
            layout = RankLocalStoreLayout(meta, 16, 16)
            keys.update(layout.key_for(0, h) for h in HASHES)
            keys.update(PoolKey(meta, h.hex()).to_string() for h in HASHES)
            keys.update(intree_worker._make_mooncake_group_id(meta, h.hex()) for h in HASHES)
        meta = KeyMetadata(model, 0, 0, 0, 0, 0, cache_prefix=prefix, store_namespace=namespace)
        for cls in (LBHNCStoreLayout, LBNHCStoreLayout):
            sharded = cls(meta, 16, 16, local_tp_size=2, store_tp_size=4, tp_rank=1, num_kv_heads=8)
            keys.update(sharded.key_for(s, h) for s in sharded.local_shard_ids for h in HASHES)
    return keys


def our_keys() -> set[str]:
    keys: set[str] = set()
    groups = (GroupSpec(Kind.FULL_ATTENTION, 16), GroupSpec(Kind.MAMBA, 16), GroupSpec(Kind.MLA, 16))
    for model, prefix in itertools.product(["tiny-llama", "m", "kvs1", "s0.c0.d0.p0.g0"], ["", "t", "kvs1"]):
        for tp, pcp, pp in ((1, 1, 1), (4, 2, 2)):
            base = Layout(model, groups, Parallel(tp_size=tp, pp_size=pp, pcp_size=pcp), 2, cache_prefix=prefix)
            for r, c, p in itertools.product(range(tp), range(pcp), range(pp)):
                geo = Geometry.of(base.for_rank(r, c, p))
                keys.update(lookup_plan(geo, HASHES, 49).keys)
                keys.update(chunk.key for chunk in save_plan(geo, HASHES, [[0, 1, 2]] * 3, 48).chunks)
    return keys


def test_no_key_of_ours_is_ever_a_key_of_the_intree_connector():
    theirs, ours = intree_keys(), our_keys()
    assert len(theirs) > 10_000 and len(ours) > 1_000
    assert theirs.isdisjoint(ours)


def test_the_structure_that_keeps_them_apart_holds_for_every_key():
    # Theirs: the field before the last '@' is always `group:<int>`; ours is `s.c.d.p.g` with no ':' (keys.py).
    for key in intree_keys():
        if key.startswith("vllm-mooncake-store:"):
            continue  # a Mooncake group id, never an object key; ours all start with kvs1@
        assert re.fullmatch(r"group:[0-9]+", key.rsplit("@", 2)[1]), key
    for key in our_keys():
        assert key.startswith("kvs1@")
        assert re.fullmatch(r"s[0-9]+\.c[0-9]+\.d[0-9]+\.p[0-9]+\.g[0-9]+", key.rsplit("@", 2)[1]), key


def test_our_reset_never_sweeps_an_intree_key():
    theirs = intree_keys()
    for model, prefix in itertools.product(["tiny-llama", "m", "kvs1"], ["", "t", "kvs1"]):
        layout = Layout(model, (GroupSpec(Kind.FULL_ATTENTION, 16),), cache_prefix=prefix)
        reset = re.compile(re.escape(key_prefix(layout.model, prefix)) + f"(?:{KEY_TAIL_PATTERN})")
        assert not any(reset.fullmatch(key) for key in theirs)
