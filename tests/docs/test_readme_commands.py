"""The README top to bottom, as a newcomer runs it: its commands in order, against the daemon its first line starts.

The first command (`bash scripts/setup.sh && .venv/bin/kvsidecar serve`) runs as written, with the defaults it
documents (the socket under /tmp, metrics on 127.0.0.1:9469), inside private mount and network namespaces
(readme_session.py), so it meets no daemon of the machine's; then, while it serves, the commands the README runs
against it (`status`, `demo`, the layout lines) and the client in ten lines. Its ready line is the README's sample
but for the time and the master's port, and every socket the README names is the one it listens on. The set-up is
the already set-up checkout's (scripts/setup.sh only checks, seconds); `bash scripts/test.sh` is this suite.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar_contract.paths import default_socket_path

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SESSION = Path(__file__).with_name("readme_session.py")
# What the client in ten lines leaves to its reader, and what it says it gets.
BEFORE_SNIPPET = "block_hashes = [bytes([i]) * 32 for i in range(1, 5)]  # a 64-token prompt's chained hashes\n"
AFTER_SNIPPET = "assert hit.hit_tokens == 64 and not failed, (hit, failed)\nclient.close()\nprint('snippet ok')\n"


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of one language ("" for plain ones), in order."""
    found, lines, fence = [], None, ""
    for line in README.splitlines():
        if not line.startswith("```"):
            if lines is not None:
                lines.append(line)
        elif lines is None:
            lines, fence = [], line[3:].strip()
        else:
            if fence == language:
                found.append("\n".join(lines))
            lines = None
    return found


def commands(block: str) -> list[str]:
    """A block's command lines as a shell runs them: comments dropped, `[--optional flags]` left out."""
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines())
    return [re.sub(r"\s*\[[^\]]*\]", "", line) for line in lines if line and not line.startswith("#")]


def ready_sample() -> str:
    (line,) = [line for block in blocks("") for line in block.splitlines() if " ready: grpc " in line]
    return line


def ready_socket(line: str) -> str:
    return re.search(r"ready: grpc unix://([^,]+),", line).group(1)


def shape(ready: str) -> str:
    """A ready line without what changes from start to start: the time and the embedded master's port."""
    return re.sub(r"(mooncake master 127\.0\.0\.1:)\d+", r"\g<1>PORT", ready.split(" ", 2)[2])


def vllm_extra_config() -> dict:
    (line,) = [line for block in blocks("bash") for line in commands(block) if line.startswith("vllm serve")]
    words = shlex.split(line)
    return json.loads(words[words.index("--kv-transfer-config") + 1]).get("kv_connector_extra_config", {})


def test_the_readme_names_one_socket_the_one_its_daemon_listens_on():
    sample = ready_socket(ready_sample())
    assert (
        sample
        == "/tmp/kvsidecar-0/kvsidecar.sock"
        == default_socket_path({}).replace(f"kvsidecar-{os.getuid()}", "kvsidecar-0")
    ), "the sample is serve's default for root without XDG_RUNTIME_DIR"
    (snippet,) = blocks("python")
    assert re.search(r'SidecarClient\.connect\("unix://([^"]+)"', snippet).group(1) == sample
    # vLLM's connector defaults to the same socket: the one-liner names none, or this one.
    assert vllm_extra_config().get("socket", f"unix://{sample}") == f"unix://{sample}"


def test_the_readme_commands_run_in_order(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        if os.environ.get("CI"):
            pytest.fail("the README's commands run in namespaces of their own: root, unshare and ip (iproute2)")
        pytest.skip("the README's commands run in namespaces of their own: needs root, unshare and ip (iproute2)")
    first, *rest = blocks("bash")
    (daemon,) = [line for line in commands(first) if "kvsidecar serve" in line]
    assert daemon == "bash scripts/setup.sh && .venv/bin/kvsidecar serve"
    said = re.findall(r"`(\.venv/bin/kvsidecar (?:status|demo))`", README)
    assert said == [".venv/bin/kvsidecar status", ".venv/bin/kvsidecar demo"], said
    layout = [line for block in rest for line in commands(block) if "kvsidecar layout" in line]
    assert len(layout) == 2, layout
    (snippet,) = blocks("python")
    plan = {"daemon": daemon, "after": [*said, *layout], "python": BEFORE_SNIPPET + snippet + AFTER_SNIPPET}
    private = tmp_path / "tmp"
    private.mkdir(mode=0o1777)
    done = subprocess.run(
        ["unshare", "--mount", "--net", "--", sys.executable, str(SESSION), str(ROOT), str(private), json.dumps(plan)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["ready"], found["log"]
    assert shape(found["ready"]) == shape(ready_sample()), found["ready"]
    runs = {" ".join(run["argv"][-1:]): run for run in found["commands"]}
    for command, run in runs.items():
        assert run["code"] == 0, f"{command}: exit {run['code']}\n{run['out']}"
    status = runs[".venv/bin/kvsidecar status"]["out"]
    assert status.startswith(f"kvsidecar 0.1.0 at unix://{ready_socket(found['ready'])}: serving"), status
    assert "OK: every rank got its own bytes back" in runs[".venv/bin/kvsidecar demo"]["out"]
    assert runs[str(Path("/tmp/readme.py"))]["out"].strip().endswith("snippet ok")
    assert found["exit"] == 0, found["log"]
