"""`kvsidecar demo`: runs the `kvsidecar-demo` command of the test machinery's distribution (testing/)."""

from __future__ import annotations

import argparse

from kvsidecar.cli import handover


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvsidecar demo ...` hands every argument to the kvsidecar-demo command."""
    p = sub.add_parser(
        "demo",
        add_help=False,  # its --help is the demo's own
        help="save and load a prompt with simulated ranks, checking every byte",
        description="Runs kvsidecar-demo (testing/): --help for its flags.",
    )
    # main() hands `kvsidecar demo ...` over before parsing; this entry only lists the command.
    p.set_defaults(func=lambda _: handover.run("demo", []))
