"""`kvsidecar bench`: runs the `kvsidecar-bench` command of the bench's own distribution (benchmarks/).

The daemon's command imports nothing of the bench: it finds the bench's console script beside its own interpreter
(the same environment), else on PATH, and hands it every argument in its place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from pathlib import Path

BENCH = "kvsidecar-bench"


def find(scripts: str | None = None, path: str | None = None) -> str | None:
    """The bench's command: in this environment's scripts folder, else on PATH; None when it is not installed."""
    beside = Path(scripts if scripts is not None else sysconfig.get_path("scripts")) / BENCH
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(BENCH, path=path)


def run(argv: list[str], command: str | None = None) -> int:
    """Become the bench with argv (`command`: where it is, found when not given); 2 when it is not installed."""
    command = command or find()
    if command is None:
        print(
            f"kvsidecar bench: the bench is not installed ({BENCH} is neither beside {sys.executable} nor on PATH): "
            "pip install ./benchmarks from a checkout (scripts/setup.sh does)",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    os.execv(command, [command, *argv])


def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvsidecar bench ...` hands every argument to the kvsidecar-bench command."""
    p = sub.add_parser(
        "bench",
        add_help=False,  # its --help is the bench's own
        help="measure the daemon's data path against in-process Mooncake, its real client and memcpy",
        description=f"Runs {BENCH} (benchmarks/): --quick for a run under a minute, --help for its flags.",
    )
    # main() hands `kvsidecar bench ...` over before parsing; this entry only lists the command.
    p.set_defaults(func=lambda _: run([]))
