#!/usr/bin/env bash
# Sets up a separate virtual environment with the real vLLM 0.33.0 (CPU torch), the kvsidecar client and pytest, for
# tests/vllm_connector. vLLM stays out of the daemon's .venv: its dependency set is large and pins its own versions.
# Idempotent: a second run only checks what is already there (a few seconds).
#   VENV_VLLM=path   where the environment goes (default .venv-vllm in the repo)
#   PYTHON=python3   the interpreter that makes the venv
#
# Never let pip resolve vLLM's own dependencies: that pulls CUDA torch and ~32 nvidia packages (~9.6 GB). vLLM is
# installed with --no-deps, then the modules its scheduler, config and KV-connector code import, pinned below.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VLLM:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.8
start=$SECONDS

# shellcheck source=scripts/vllm-venv.sh
. scripts/vllm-venv.sh

# 1. The CPU torch wheel first (the CPU build; vLLM's metadata would pull the CUDA one).
installed torch "$TORCH_VERSION+cpu" || installed torch "$TORCH_VERSION" || pip install "torch==$TORCH_VERSION"

# 2. vLLM itself, without its dependencies.
install_without_deps vllm "$VLLM_VERSION"

# 3. What vLLM's config, scheduler and connector code import, with versions that fit vLLM 0.33.0.
constraints="$VENV/vllm-constraints.txt"
cat >"$constraints" <<EOF
torch==$TORCH_VERSION
transformers>=5.16.1,<5.21.0
fastapi>=0.133.0,<0.137.0
llguidance>=1.7.0,<1.8.0
xgrammar==$XGRAMMAR_VERSION
apache-tvm-ffi==0.1.11
huggingface_hub>=1.31.0
tokenizers>=0.23.2
pydantic>=2.12.0
protobuf>=7.35.1,<8
grpcio>=1.85.1
EOF
# --no-warn-conflicts: pip would list every vLLM dependency left out on purpose (CUDA kernels, serving extras).
pip install --no-warn-conflicts -c "$constraints" \
  packaging numpy psutil pyzmq urllib3 regex transformers cbor2 aiohttp requests oss-harmony openai pillow \
  pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus-client fastapi partial-json-parser \
  llguidance apache-tvm-ffi einops

# 4. xgrammar without its dependencies (they pull ~1 GB of triton that CPU code never uses).
installed xgrammar "$XGRAMMAR_VERSION" || pip install --no-deps --no-warn-conflicts "xgrammar==$XGRAMMAR_VERSION"

# 5. The kvsidecar client (grpcio, protobuf) and the test tools.
pip install --no-warn-conflicts -c "$constraints" -e ./contract -e ./client pytest pytest-timeout

# The client's grpcio and protobuf must also be versions vLLM accepts: check them against vLLM's own metadata.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
from packaging.requirements import Requirement

bad = []
for line in m.requires("vllm") or []:
    req = Requirement(line)
    if req.name.lower() in {"protobuf", "grpcio"} and (req.marker is None or req.marker.evaluate({"extra": ""})):
        have = m.version(req.name)
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} does not satisfy vLLM's {req}")
if bad:
    raise SystemExit("setup-vllm: " + "; ".join(bad))
PY

echo "setup-vllm: $VENV ready (vllm $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))'),"\
  "$(du -sh "$VENV" 2>/dev/null | cut -f1), $((SECONDS - start)) s)"
