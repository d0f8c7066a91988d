"""`kvsidecar bench`: hands every argument to the kvsidecar-bench tool (benchmarks/), imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys


def run(argv: list[str]) -> int:
    if importlib.util.find_spec("kvsidecar_bench") is None:
        print("kvsidecar bench: the bench is not installed: pip install -e ./benchmarks", file=sys.stderr)
        return 2
    runner = importlib.import_module("kvsidecar_bench.runner")
    code: int = runner.main(argv)
    return code


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvsidecar bench ...` hands every argument to the kvsidecar-bench tool, imported only when it runs."""
    p = sub.add_parser(
        "bench",
        add_help=False,  # its --help is the bench's own
        help="measure the daemon's data path against in-process Mooncake, its real client and memcpy",
        description="Runs kvsidecar-bench (benchmarks/): --quick for a run under a minute, --help for its flags.",
    )
    # main() hands `kvsidecar bench ...` over before parsing; this entry only lists the command.
    p.set_defaults(func=lambda _: run([]))
