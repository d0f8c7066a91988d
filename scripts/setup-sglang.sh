#!/usr/bin/env bash
# Sets up a lean virtual environment with SGLang 0.5.23 on CPU torch for tests/sglang: enough of SGLang to import
# its HiCache storage interface, its backend factory, its host pools (MHA, MLA, Mamba) and its mmap/shm allocator,
# plus the kvsidecar contract and client and pytest. A whole SGLang engine cannot run here (its CPU kernels are
# built from a source checkout; the wheel's kernels are CUDA), so this is not an engine, only SGLang's own classes
# the backend meets. Idempotent: a second run only checks what is already there.
#   VENV_SGLANG=path   where the environment goes (default .venv-sglang in the repo)
#   PYTHON=python3     the interpreter that makes the venv
#
# Never let pip resolve SGLang's dependencies as published: they pin CUDA torch 2.14 and dozens of CUDA packages.
# So sglang goes in with --no-deps, then only what those imports need. Two of them go in without their own
# dependencies: triton (sglang.srt.utils imports it at the top; on CPU it is only imported) and torchvision 0.16.2
# (sglang's model configs import its transforms; PyPI's Linux torchvision builds are CUDA builds whose C extension
# cannot load beside CPU torch, and from 0.17 on torchvision then fails at import, registering fake kernels for C
# ops that do not exist; 0.16.2's Python part imports with a warning).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_SGLANG:-.venv-sglang}
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
start=$SECONDS

# shellcheck source=scripts/vllm-venv.sh
. scripts/vllm-venv.sh

installed torch "$TORCH_VERSION+cpu" || installed torch "$TORCH_VERSION" || pip install "torch==$TORCH_VERSION"
install_without_deps sglang "$SGLANG_VERSION"
installed triton 3.9.0 || pip install --no-deps --no-warn-conflicts triton==3.9.0
installed torchvision 0.16.2 || pip install --no-deps --no-warn-conflicts torchvision==0.16.2

constraints="$VENV/sglang-constraints.txt"
cat >"$constraints" <<EOC
torch==$TORCH_VERSION
transformers==5.19.0
apache-tvm-ffi==0.1.11
protobuf>=7.35.1,<8
grpcio>=1.85.1
EOC
# What importing those modules needs (found by importing them until nothing was missing), versions as SGLang pins them.
pip install --no-warn-conflicts -c "$constraints" aiohttp anyio apache-tvm-ffi compressed-tensors dill gguf ipython \
  msgspec numpy orjson packaging pillow psutil pybase64 pydantic pyzmq requests sentencepiece starlette tqdm transformers
pip install --no-warn-conflicts -c "$constraints" -e ./contract -e ./client pytest pytest-timeout

"$VENV/bin/python" -W ignore -c "
import torch, sys
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.pool_host.mamba
import sglang.srt.mem_cache.storage.mmap.mmap_allocator
sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') and not torch.cuda.is_available() else
         'setup-sglang: torch ' + torch.__version__ + ' is not the CPU build')"

echo "setup-sglang: $VENV ready (sglang $SGLANG_VERSION, $(du -sh "$VENV" 2>/dev/null | cut -f1), $((SECONDS - start)) s)"
