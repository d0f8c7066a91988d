"""A newcomer's terminal session with the README, run inside private mount and network namespaces.

Usage: unshare --mount --net -- python readme_session.py ROOT TMP COMMANDS_JSON. /tmp is TMP here and loopback is
the namespace's own, so the README's commands run exactly as written (the default socket under /tmp, metrics on
127.0.0.1:9469) without meeting a daemon of the machine's. COMMANDS_JSON: {"daemon": the line that starts it,
"after": [commands run while it serves], "python": a program run with the venv's python}. Prints one JSON line:
the daemon's ready line, each command's exit status and output, and the daemon's exit status after SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 180.0
COMMAND_TIMEOUT_S = 180.0


def main(root: str, tmp: str, commands: dict[str, Any]) -> dict[str, Any]:
    checkout = Path(root).resolve()
    if Path("/tmp") in checkout.parents:
        # A checkout under /tmp (a CI clone) stays where it is, so that its venv's scripts find their python.
        inside = Path(tmp) / checkout.relative_to("/tmp")
        inside.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(checkout), str(inside)], check=True)
    subprocess.run(["mount", "--rbind", tmp, "/tmp"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # A newcomer's shell: no runtime directory (the socket goes under /tmp) and nothing of the test session's.
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR" and not k.startswith(("MC_", "PYTEST"))}
    log = Path("/tmp/daemon.log")
    with open(log, "w") as out:
        daemon = subprocess.Popen(
            ["bash", "-c", str(commands["daemon"])], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    ready, ran = "", []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready and daemon.poll() is None and time.monotonic() < deadline:
        ready = next((line for line in log.read_text().splitlines() if " ready: " in line), "")
        time.sleep(0.1)
    found: dict[str, Any] = {"ready": ready, "commands": ran}
    try:
        if ready:
            runs = [["bash", "-c", line] for line in commands["after"]]
            program = Path("/tmp/readme.py")
            program.write_text(commands["python"])
            runs.append([".venv/bin/python", str(program)])
            for argv in runs:
                done = subprocess.run(
                    argv, cwd=root, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
                )
                ran.append({"argv": argv, "code": done.returncode, "out": done.stdout + done.stderr})
    finally:
        if ready and daemon.poll() is None:
            # SIGTERM to the daemon, as Ctrl-C or systemd would stop it; the shell that started it passes its status.
            os.kill(_peer_pid(ready.split("grpc unix://", 1)[1].split(",")[0]), signal.SIGTERM)
        try:
            found["exit"] = daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            found["exit"] = daemon.wait(10)
        found["log"] = log.read_text()[-4000:]
    return found


def _peer_pid(path: str) -> int:
    """The PID of the process listening on a Unix socket, from the kernel's peer credentials."""
    with socket.socket(socket.AF_UNIX) as probe:
        probe.connect(path)
        pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
