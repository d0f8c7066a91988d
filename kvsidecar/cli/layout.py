"""`kvsidecar layout`: the placement of a layout as a table or JSON, for operators."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from typing import Any

from kvsidecar_contract.placement import (
    DEFAULT_CHECKSUM_EVERY,
    Geometry,
    Layout,
    Parallel,
    PlacementError,
    RecurrentState,
    block_key,
    parse_groups,
)
from kvsidecar_contract.placement.geometry import GroupGeometry
from kvsidecar_contract.placement.layout import MAX_TP

EXAMPLE_HASH = bytes(32)
PER_INDEX = -1  # share_tp_size of the bare --share-across-tp: one value per KV head and per state index
# The layout's parameters, as the placement rules name them in their errors, and the flags that set them.
FLAGS = {
    "num_kv_heads": "--kv-heads",
    "tp_size": "--tp",
    "dcp_size": "--dcp",
    "pp_size": "--pp",
    "pcp_size": "--pcp",
    "hash_block_size": "--hash-block-size",
    "block_size": "--block-size",
    "share_tp_size": "--share-across-tp",
}


def in_flags(message: str, tp_flag: str = "--tp") -> str:
    """A placement error in the words of the flags: `num_kv_heads 2 and tp_size 3` -> `--kv-heads 2 and --tp 3`."""
    names = {**FLAGS, "tp_size": tp_flag}
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m[1]], message)


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
    checksum_every: int = DEFAULT_CHECKSUM_EVERY,
) -> Layout:
    """A layout seen from TP rank 0 (pcp and pp rank 0), from CLI-style arguments.

    share_tp_size PER_INDEX: one value per KV head and per index of every state axis (rules 11, 12), as the
    connector's `share_across_tp: true` means.
    """
    specs = parse_groups(groups, block_size)
    if share_tp_size == PER_INDEX:
        sizes = [a.size for g in specs if g.state is not None for a in g.state.axes]
        share_tp_size = min(MAX_TP, max([kv_heads, *sizes]))
    return Layout(
        model=model,
        groups=specs,
        parallel=Parallel(tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp),
        num_kv_heads=kv_heads,
        hash_block_size=hash_block_size,
        cache_prefix=cache_prefix,
        value_identity=value_identity,
        share_tp_size=share_tp_size,
        checksum_every=checksum_every,
    )


def describe(layout: Layout) -> dict[str, Any]:
    """The placement of every group on every TP rank, as plain JSON-ready values."""
    par = layout.parallel
    geo = Geometry.of(layout)
    groups: list[dict[str, Any]] = []
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
                "model_key": layout.group_model_key(group.index),
                "writers_of_chunk0": [r for r, rank in enumerate(ranks) if rank.groups[group.index].writes(0)],
                "example_key_of_rank": [_example_key(layout, group, r) for r in range(par.tp_size)],
            }
        )
        if group.spec.state is not None:
            groups[-1]["state"] = _state(layout, group.index, group.spec.state, ranks)
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


def _state(layout: Layout, g: int, state: RecurrentState, ranks: list[Geometry]) -> dict[str, Any]:
    """A recurrent group's state: its axes, and where shared (rule 12) each piece with who holds and writes it."""
    tp = layout.parallel.tp_size
    out: dict[str, Any] = {
        "axes": [{"name": a.name, "size": a.size, "repeat": a.repeat} for a in state.axes],
        "layer_bytes_of_rank": state.layer_bytes(tp),
    }
    if not layout.shared(g):
        return out
    pieces = []
    for v, piece in enumerate(state.pieces(layout.share_tp_size)):
        holders = list(state.holders(piece, tp))
        # Which of its values the piece is on each holder decides who writes it (rule 4 per piece).
        writer = next(
            r for r in holders if ranks[r].groups[g].writes_part(list(layout.values_of_rank(g, r)).index(v), 0)
        )
        pieces.append(
            {
                "shard": v,
                "piece": state.label(piece),
                "bytes_per_layer": state.piece_bytes(piece),
                "held_by": holders,
                "writer_of_chunk0": writer,
            }
        )
    out["pieces"] = pieces
    return out


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
        labels = _piece_labels(reader, g)
        reads = [
            {
                "rank": r,
                "values": [
                    {"key": key, "written_by": written.get(key), **labels.get(key.rsplit("@", 2)[1], {})}
                    for key in (block_key(prefix, EXAMPLE_HASH) for prefix in geo.groups[g].own)
                ],
            }
            for r, geo in enumerate(readers_)
        ]
        out.append({"index": g, "spec": spec.describe(), "shared_across_tp": layout.shared(g), "reads": reads})
    return out


def _piece_labels(layout: Layout, g: int) -> dict[str, dict[str, str]]:
    """Rule 12: the shard field of each piece of a shared state group -> {"piece": its label}."""
    state = layout.groups[g].state
    if state is None or not layout.shared(g):
        return {}
    prefix = ".c0.d0.p{p}.g{g}"
    return {
        f"s{v}" + prefix.format(p=p, g=g): {"piece": state.label(piece)}
        for v, piece in enumerate(state.pieces(layout.share_tp_size))
        for p in range(layout.parallel.pp_size)
    }


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
                piece = f" ({value['piece']})" if "piece" in value else ""
                lines.append(f"    reader rank {read['rank']}: {value['key']}{piece}  <- {by}")
    return "\n".join(lines)


def render_table(info: dict[str, Any]) -> str:
    """A fixed-width table an operator can read in a terminal."""
    # The model field every key carries: one per layout, or per group where groups are shared across TP sizes.
    model_keys = sorted({g["model_key"] for g in info["groups"]})
    model = model_keys[0] if len(model_keys) == 1 else f"{info['model']} (value id per group: see its keys)"
    lines = [
        f"model {model}  tp {info['tp']}  kv_heads {info['kv_heads']}  dcp {info['dcp']}  "
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
    lines += ["", "keys of chunk 0 (hash 00 x 32, pcp 0, pp 0), the ranks that hold each and the one that writes it:"]
    for g in info["groups"]:
        holders: dict[str, list[int]] = {}
        for rank, key in enumerate(g["example_key_of_rank"]):
            holders.setdefault(key, []).append(rank)
        for key, ranks in holders.items():
            writers = " ".join(str(r) for r in ranks if r in g["writers_of_chunk0"]) or "none of them"
            held = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {' '.join(map(str, ranks))}"
            lines.append(f"  group {g['index']} held by {held}, written by {writers}: {key}")
    shared = [g for g in info["groups"] if "pieces" in g.get("state", {})]
    if shared:
        lines += ["", "recurrent state in pieces every TP size reads (rule 12), chunk 0:"]
    for g in shared:
        state = g["state"]
        lines.append(
            f"  group {g['index']} ({g['spec']}): {len(state['pieces'])} pieces per block, "
            f"{state['layer_bytes_of_rank']} bytes of state per layer on a rank"
        )
        rows = [
            (
                f"s{p['shard']}",
                p["piece"],
                f"{p['bytes_per_layer']} B/layer",
                "held by tp rank" + ("s " if len(p["held_by"]) > 1 else " ") + " ".join(map(str, p["held_by"])),
                f"written by {p['writer_of_chunk0']}",
            )
            for p in state["pieces"]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
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
            share_tp_size=args.share_across_tp,
            checksum_every=args.checksum_every,
        )
        info = describe(layout)
    except PlacementError as exc:
        print(f"kvsidecar layout: error: {in_flags(str(exc))}", file=sys.stderr)
        return 2
    if args.reader_tp:
        try:
            info["reader"] = {"tp": args.reader_tp, "groups": readers(layout, args.reader_tp)}
        except PlacementError as exc:  # the reader's TP size is the one that does not fit
            print(f"kvsidecar layout: error: {in_flags(str(exc), '--reader-tp')}", file=sys.stderr)
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
        "uniform(a+b), or a recurrent layer whose state can be shared across TP sizes: "
        "mamba2(heads=H,head_dim=D,state=S,groups=G,conv=K), gdn(k_heads=,v_heads=,k_dim=,v_dim=,conv=), "
        "kda(heads=,head_dim=,conv=), each optionally with layout=sd|ds, bytes=, ssm_bytes=, spec=; "
        "append /N for a block size of N tokens (default full_attention)",
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
        const=PER_INDEX,
        default=0,
        metavar="N",
        help="store shareable groups for every TP size (docs/placement.md rules 11 and 12), as the connector's "
        "share_across_tp does: alone, one value per KV head and per state head or group; with N, values cut as a "
        "TP=N engine holds its heads",
    )
    p.add_argument(
        "--reader-tp",
        type=int,
        default=0,
        help="also show, for a reader of this TP size, which values each of its ranks loads and which writer rank "
        "stored them",
    )
    p.add_argument(
        "--checksum-every",
        type=int,
        default=DEFAULT_CHECKSUM_EVERY,
        metavar="N",
        help="the daemon's checksum rule, which keys carry as the value id: one value in N has a checksum (its "
        f"--checksum-every; 1 with --checksums all, 0 with off) (default {DEFAULT_CHECKSUM_EVERY})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
