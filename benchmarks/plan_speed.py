"""How fast the placement core plans: lookup keys per second for a 128k-token prompt.

    python benchmarks/plan_speed.py [--tokens 131072] [--repeat 20]

Layout: U=16, T=8, H=8, groups [mla, full_attention, mamba], 16-token blocks (17 namespaces per boundary).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvsidecar_contract.placement import Geometry, Layout, Parallel, compute_hit, load_plan, lookup_plan, parse_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    layout = Layout("org/Model", parse_groups("mla,full_attention,mamba", 16), Parallel(tp_size=8), 8, 16)
    geo = Geometry.of(layout)
    hashes = [i.to_bytes(32, "big") for i in range(args.tokens // 16)]
    ids = [list(range(len(hashes)))] * 3

    plan_s, hit_s, load_s = [], [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plan = lookup_plan(geo, hashes, args.tokens)
        t1 = time.perf_counter()
        hit = compute_hit(geo, args.tokens, plan.stored([True] * len(plan.keys)))
        t2 = time.perf_counter()
        load_plan(geo, hashes, ids, hit.hit_tokens, hit.tail_boundaries)
        t3 = time.perf_counter()
        plan_s.append(t1 - t0)
        hit_s.append(t2 - t1)
        load_s.append(t3 - t2)
    keys = len(plan.keys)
    med = statistics.median(plan_s)
    print(f"prompt {args.tokens} tokens, {len(hashes)} hashes, {keys} probe keys")
    print(f"lookup plan : {med * 1e3:7.2f} ms median  -> {keys / med / 1e6:5.2f} M keys/s")
    print(f"quorum + hit: {statistics.median(hit_s) * 1e3:7.2f} ms median  (hit {hit.hit_tokens} tokens)")
    print(f"load plan   : {statistics.median(load_s) * 1e3:7.2f} ms median")


if __name__ == "__main__":
    main()
