"""The `kvsidecar` command line: one module per subcommand, each with `add(subparsers)`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvsidecar import __version__
from kvsidecar.cli import bench, demo, layout, serve, status, tokens

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="kvsidecar", description="Node-local KV-cache store daemon.")
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (serve, status, layout, tokens, demo, bench):
        command.add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return bench.run(argv[1:])
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
