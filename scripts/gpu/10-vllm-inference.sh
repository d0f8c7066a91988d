#!/usr/bin/env bash
# GPU check 10: real vLLM 0.33 (the CUDA wheel) with a tiny random-weight Llama, the kvsidecar daemon with the CUDA
# Mooncake build (FLAVOUR=cuda), the KV cache shared with the daemon over CUDA IPC. A cold engine saves; a new
# engine (fresh GPU memory) loads the prefix from the store and its greedy tokens equal the cold ones; the same
# pass with noise over every loaded block changes them (the check would see wrong bytes).
# Two venvs, as deployed: vLLM + the client, and the daemon (no vLLM). uv installs both (much faster than pip) and
# shares one wheel cache, so the daemon's torch is the same wheel as vLLM's and is not downloaded twice.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
WORK=${GPU_CHECK_WORK:-/tmp/kvsidecar-gpu-check}/10-vllm-inference
VLLM_VERSION=0.33.0
mkdir -p "$WORK"
export UV_CACHE_DIR="$WORK/uv-cache" UV_LINK_MODE=hardlink
step() { echo "[$((SECONDS))s] $*"; }

command -v nvidia-smi >/dev/null || { echo "FAIL: no nvidia-smi: this check needs a CUDA GPU"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# uv itself, from PyPI, in a venv of its own.
[ -x "$WORK/uv/bin/uv" ] || { python3 -m venv "$WORK/uv" && "$WORK/uv/bin/pip" -q install uv; }
UV="$WORK/uv/bin/uv"

step "vLLM $VLLM_VERSION (CUDA wheel and its own dependencies) + the kvsidecar client"
[ -x "$WORK/vllm/bin/python" ] || "$UV" venv -q --python python3 "$WORK/vllm"
"$UV" pip install -q --python "$WORK/vllm/bin/python" "vllm==$VLLM_VERSION" pytest \
  -e "$REPO/contract" -e "$REPO/client"
TORCH=$("$WORK/vllm/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')

step "the daemon (FLAVOUR=cuda: mooncake-transfer-engine) with vLLM's torch $TORCH"
[ -x "$WORK/daemon/bin/python" ] || "$UV" venv -q --seed --python python3 "$WORK/daemon"
"$UV" pip install -q --python "$WORK/daemon/bin/python" "torch==$TORCH"
VENV="$WORK/daemon" FLAVOUR=cuda bash scripts/setup.sh

step "cold, warm and noisy passes"
export KVSIDECAR_PYTHON="$WORK/daemon/bin/python"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CACHE_ROOT="$WORK/cache/vllm" HF_HOME="$WORK/cache/hf" \
  XDG_CACHE_HOME="$WORK/cache/xdg" PYTHONPATH="$REPO/tests/vllm_real:$REPO/tests/vllm_connector"
timeout 420 "$WORK/vllm/bin/python" scripts/gpu/vllm_inference.py "$WORK/run"
step "done"
