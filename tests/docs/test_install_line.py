"""The one line a vLLM user runs to install the client, as the README, docs/vllm.md and deploy/README.md give it,
run as written in a fresh venv (no system site-packages): it installs, and the client and its connector import.

`pip install ./client` alone asks the index for `kvsidecar-contract==0.1.0`, which lives only in this checkout, so the
line names both local distributions: the contract stays one copy, shared by the daemon and the client. About 15 s
here (venv 6 s, install 9 s from pip's cache).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_LINE = "pip install ./contract ./client"
DOCS = ("README.md", "docs/vllm.md", "deploy/README.md")


def test_every_doc_gives_the_same_install_line():
    for name in DOCS:
        text = (ROOT / name).read_text()
        assert INSTALL_LINE in text, f"{name} does not give `{INSTALL_LINE}`"
        # Any other install of ./client (one without ./contract) is the line that fails in a fresh venv.
        installs = re.findall(r"pip install (?:(?!pip install)[^`])*?\./client\b", " ".join(text.split()))
        assert installs and all(i.startswith(INSTALL_LINE) for i in installs), f"{name}: {installs}"
    # The image installs the same two distributions, from its copy of the checkout.
    assert re.search(r"pip install /src/contract /src/client ", (ROOT / "Dockerfile").read_text())


def test_the_install_line_installs_the_client_in_a_fresh_venv(tmp_path):
    # A copy of the two folders, so the build leaves nothing in the checkout (pip builds in-tree: build/, egg-info).
    leftovers = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    for name in ("contract", "client"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=leftovers)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    installed = subprocess.run(
        ["bash", "-c", INSTALL_LINE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    code = (
        "import kvsidecar_client, kvsidecar_client.vllm, kvsidecar_contract\n"
        "from kvsidecar_client import SidecarClient\n"
        "print(kvsidecar_client.__file__, kvsidecar_contract.__file__)\n"
    )
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert imported.returncode == 0, imported.stderr
    assert all(Path(p).is_relative_to(venv) for p in imported.stdout.split()), imported.stdout
