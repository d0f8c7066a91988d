"""`kvsidecar bench`: runs the `kvsidecar-bench` command of the bench's own distribution (benchmarks/)."""

from __future__ import annotations

import argparse

from kvsidecar.cli import handover


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvsidecar bench ...` hands every argument to the kvsidecar-bench command."""
    p = sub.add_parser(
        "bench",
        add_help=False,  # its --help is the bench's own
        help="measure the daemon's data path against in-process Mooncake, its real client and memcpy",
        description="Runs kvsidecar-bench (benchmarks/): --quick for a run under a minute, --help for its flags.",
    )
    # main() hands `kvsidecar bench ...` over before parsing; this entry only lists the command.
    p.set_defaults(func=lambda _: handover.run("bench", []))
