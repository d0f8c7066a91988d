"""The `kvsidecar` command: `serve`, `status` and operator tools; each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvsidecar import __version__
from kvsidecar.placement import PlacementError


def _layout(args: argparse.Namespace) -> int:
    from kvsidecar.layout_view import build_layout, describe, render_table

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
            block_size=args.block_size,
            hash_block_size=args.hash_block_size or args.block_size,
        )
        info = describe(layout)
    except PlacementError as exc:
        print(f"kvsidecar layout: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else render_table(info))
    return 0


def _add_layout(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--block-size", type=int, default=16, help="tokens per physical block (default 16)")
    p.add_argument("--hash-block-size", type=int, default=0, help="U, tokens per block hash (default: block size)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_layout)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="kvsidecar", description="Node-local KV-cache store daemon.")
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_layout(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
