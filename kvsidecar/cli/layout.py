"""`kvsidecar layout`: the placement of a layout as a table or JSON, for operators."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from kvsidecar_contract.placement import Geometry, Layout, Parallel, PlacementError, block_key, parse_groups
from kvsidecar_contract.placement.geometry import GroupGeometry

EXAMPLE_HASH = bytes(32)


def build_layout(
    *,
    tp: int,
    kv_heads: int,
    groups: str,
    dcp: int = 1,
    pp: int = 1,
    pcp: int = 1,
    model: str = "model",
    cache_prefix: str = "",
    value_identity: str = "",
    block_size: int = 16,
    hash_block_size: int = 16,
    share_tp_size: int = 0,
) -> Layout:
    """A layout seen from TP rank 0 (pcp and pp rank 0), from CLI-style arguments."""
    return Layout(
        model=model,
        groups=parse_groups(groups, block_size),
        parallel=Parallel(tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp),
        num_kv_heads=kv_heads,
        hash_block_size=hash_block_size,
        cache_prefix=cache_prefix,
        value_identity=value_identity,
        share_tp_size=share_tp_size,
    )


def describe(layout: Layout) -> dict[str, Any]:
    """The placement of every group on every TP rank, as plain JSON-ready values."""
    par = layout.parallel
    geo = Geometry.of(layout)
    groups = []
    ranks = [Geometry.of(layout.for_rank(r, par.pcp_rank, par.pp_rank)) for r in range(par.tp_size)]
    for group in geo.groups:
        f = group.factor
        shards = [rank.groups[group.index].shard for rank in ranks]
        groups.append(
            {
                "index": group.index,
                "kind": group.spec.kind.value,
                "spec": group.spec.describe(),
                "members": [k.value for k in group.spec.members],
                "block_size": group.spec.block_size,
                "span_tokens": group.span,
                "window": group.spec.window or None,
                "replication_factor": f,
                "shared_across_tp": group.shared,
                "values_per_block": len(group.own),
                "keys_per_boundary": group.keys_per_boundary,
                "shard_of_rank": shards,
                "writers_of_chunk0": [r for r, rank in enumerate(ranks) if rank.groups[group.index].writes(0)],
                "example_key_of_rank": [_example_key(layout, group, r) for r in range(par.tp_size)],
            }
        )
    return {
        "model": layout.model,
        "model_key": layout.model_key,
        "cache_prefix": layout.cache_prefix,
        "tp": par.tp_size,
        "kv_heads": layout.num_kv_heads,
        "dcp": par.dcp_size,
        "pp": par.pp_size,
        "pcp": par.pcp_size,
        "hash_block_size": layout.hash_block_size,
        "fine_grained_hits": geo.fine_grained,
        "hit_alignment_tokens": geo.unit,
        "share_tp_size": layout.share_tp_size,
        "groups": groups,
    }


def readers(layout: Layout, reader_tp: int) -> list[dict[str, Any]]:
    """Per group, which values each rank of a reader with another TP size loads for chunk 0, and who wrote them.

    The writer is `layout`; the reader is the same engine at TP `reader_tp`. A value no writer rank stores is a miss
    for the reader (groups kept per layout: rule 11), never another layout's bytes.
    """
    par = layout.parallel
    reader = replace(
        layout, parallel=Parallel(tp_size=reader_tp, pp_size=par.pp_size, pcp_size=par.pcp_size, dcp_size=par.dcp_size)
    )
    writers = [Geometry.of(layout.for_rank(r)) for r in range(par.tp_size)]
    readers_ = [Geometry.of(reader.for_rank(r)) for r in range(reader_tp)]
    out = []
    for g, spec in enumerate(layout.groups):
        written = {
            block_key(prefix, EXAMPLE_HASH): r
            for r, geo in enumerate(writers)
            if geo.groups[g].writes(0)
            for prefix in geo.groups[g].own
        }
        reads = [
            {
                "rank": r,
                "values": [
                    {"key": key, "written_by": written.get(key)}
                    for key in (block_key(prefix, EXAMPLE_HASH) for prefix in geo.groups[g].own)
                ],
            }
            for r, geo in enumerate(readers_)
        ]
        out.append({"index": g, "spec": spec.describe(), "shared_across_tp": layout.shared(g), "reads": reads})
    return out


def render_readers(reader_tp: int, writer_tp: int, groups: list[dict[str, Any]]) -> str:
    """The reader table: each reader rank's values of chunk 0 and the writer rank that stored each."""
    lines = [f"a reader at tp {reader_tp} of values written at tp {writer_tp} (chunk 0):"]
    for g in groups:
        how = "shared across TP sizes" if g["shared_across_tp"] else "per layout: another TP size misses"
        lines.append(f"  group {g['index']} ({g['spec']}, {how})")
        for read in g["reads"]:
            for value in read["values"]:
                who = value["written_by"]
                by = f"written by tp rank {who}" if who is not None else "written by nobody: a miss"
                lines.append(f"    reader rank {read['rank']}: {value['key']}  <- {by}")
    return "\n".join(lines)


def render_table(info: dict[str, Any]) -> str:
    """A fixed-width table an operator can read in a terminal."""
    lines = [
        f"model {info['model_key']}  tp {info['tp']}  kv_heads {info['kv_heads']}  dcp {info['dcp']}  "
        f"pp {info['pp']}  pcp {info['pcp']}  U {info['hash_block_size']}  "
        f"hits in steps of {info['hit_alignment_tokens']} tokens"
        + ("  (fine-grained)" if info["fine_grained_hits"] else ""),
        "",
    ]
    header = ("group", "kind", "span", "factor", "keys/boundary", "shard of rank", "writers of chunk 0")
    rows = [header] + [
        (
            str(g["index"]),
            g["spec"],
            str(g["span_tokens"]),
            str(g["replication_factor"]),
            str(g["keys_per_boundary"]),
            " ".join(map(str, g["shard_of_rank"])),
            " ".join(map(str, g["writers_of_chunk0"])),
        )
        for g in info["groups"]
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += ["", "keys of chunk 0 (hash 00 x 32, pcp 0, pp 0):"]
    for g in info["groups"]:
        seen: set[str] = set()
        for rank, key in enumerate(g["example_key_of_rank"]):
            if key not in seen:
                seen.add(key)
                lines.append(f"  group {g['index']} rank {rank}: {key}")
    return "\n".join(lines)


def _example_key(layout: Layout, group: GroupGeometry, tp_rank: int) -> str:
    own = Geometry.of(layout.for_rank(tp_rank)).groups[group.index]
    return " ".join(block_key(prefix, EXAMPLE_HASH) for prefix in own.own)


def run(args: argparse.Namespace) -> int:
    try:
        layout = build_layout(
            tp=args.tp,
            kv_heads=args.kv_heads,
            groups=args.groups,
            dcp=args.dcp,
            pp=args.pp,
            pcp=args.pcp,
            model=args.model,
            cache_prefix=args.cache_prefix,
            value_identity=args.value_identity,
            block_size=args.block_size,
            hash_block_size=args.hash_block_size or args.block_size,
            share_tp_size=args.kv_heads if args.share_across_tp == -1 else args.share_across_tp,
        )
        info = describe(layout)
        if args.reader_tp:
            info["reader"] = {"tp": args.reader_tp, "groups": readers(layout, args.reader_tp)}
    except PlacementError as exc:
        print(f"kvsidecar layout: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(render_table(info))
        if args.reader_tp:
            print()
            print(render_readers(args.reader_tp, info["tp"], info["reader"]["groups"]))
    return 0


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "layout",
        help="show which rank writes which KV block under which key",
        description="Show the placement of a layout: replication factor, shard ids, quorum and keys per group.",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size T (default 1)")
    p.add_argument("--kv-heads", type=int, default=1, help="total KV heads H of ordinary attention (default 1)")
    p.add_argument(
        "--groups",
        default="full_attention",
        help="comma-separated group kinds: full_attention, sliding_window:W, mla, sliding_window_mla:W, mamba, "
        "uniform(a+b); append /N for a block size of N tokens (default full_attention)",
    )
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size D (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size P (default 1)")
    p.add_argument("--pcp", type=int, default=1, help="prefill-context-parallel size C (default 1)")
    p.add_argument("--model", default="model", help="model name; keys use its last path component")
    p.add_argument("--cache-prefix", default="", help="tenant/deployment namespace prepended to every key")
    p.add_argument(
        "--value-identity",
        default="",
        help="the engine's value identity (its connector logs it; docs/values.md), which keys carry as the value id",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per physical block (default 16)")
    p.add_argument("--hash-block-size", type=int, default=0, help="U, tokens per block hash (default: block size)")
    p.add_argument(
        "--share-across-tp",
        type=int,
        nargs="?",
        const=-1,
        default=0,
        metavar="N",
        help="store shareable groups for every TP size (docs/placement.md rule 11), as the connector's "
        "share_across_tp does: alone, one value per KV head; with N, values cut as a TP=N engine holds its heads",
    )
    p.add_argument(
        "--reader-tp",
        type=int,
        default=0,
        help="also show, for a reader of this TP size, which values each of its ranks loads and which writer rank "
        "stored them",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
