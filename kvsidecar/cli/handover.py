"""The subcommands that are tools of their own distributions: `kvsidecar bench` becomes `kvsidecar-bench`
(benchmarks/), `kvsidecar demo` becomes `kvsidecar-demo` (testing/).

The daemon's command imports nothing of them: it finds the tool's console script beside its own interpreter (the
same environment), else on PATH, and hands it every argument in its place.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = ["TOOLS", "find", "run"]

# subcommand -> (the tool's console script, where it comes from)
TOOLS = {
    "bench": ("kvsidecar-bench", "pip install ./benchmarks from a checkout (scripts/setup.sh does)"),
    "demo": ("kvsidecar-demo", "pip install ./testing from a checkout (scripts/setup.sh does)"),
}


def find(script: str, scripts: str | None = None, path: str | None = None) -> str | None:
    """The tool's command: in this environment's scripts folder, else on PATH; None when it is not installed."""
    beside = Path(scripts if scripts is not None else sysconfig.get_path("scripts")) / script
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(script, path=path)


def run(subcommand: str, argv: list[str], command: str | None = None) -> int:
    """Become the subcommand's tool with argv (`command`: where it is, found when not given); 2 when it is not
    installed."""
    script, install = TOOLS[subcommand]
    command = command or find(script)
    if command is None:
        print(
            f"kvsidecar {subcommand}: {script} is not installed (neither beside {sys.executable} nor on PATH): "
            f"{install}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    os.execv(command, [command, *argv])
