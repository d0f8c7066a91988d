"""The committed generated code is what scripts/gen_proto.sh makes from proto/ today."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "contract" / "kvsidecar_contract" / "proto"


def test_generated_code_is_fresh(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PY=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh")], check=True, env=env, timeout=120)
    for name in ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        assert (GENERATED / name).read_text() == fresh, f"{name} is stale: run scripts/gen_proto.sh and commit"
