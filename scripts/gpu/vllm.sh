#!/usr/bin/env bash
# scripts/gpu-check.sh's vllm section (PyPI reachable: vLLM's CUDA wheel is several GB): real vLLM 0.33 through a
# real daemon on this GPU, the KV cache shared over CUDA IPC, Mooncake's CUDA build.
#   1. inference: a tiny random-weight Llama; a new engine loads the cold engine's prefix from the store and its
#      greedy tokens equal the cold ones, and noise over every loaded block changes them (scripts/gpu/vllm_inference.py)
#   2. layouts: every KVCacheLayout vLLM allocates, as CUDA tensors of vLLM's own allocate_kv_cache, registered by the
#      connector and round-tripped byte for byte (tests/vllm_connector/test_layouts.py, KVSIDECAR_TEST_DEVICE=cuda)
#   3. serving: benchmarks/serving.py --preset gpu --device cuda (TTFT cold, warm from the store on a fresh engine,
#      vLLM's own prefix cache as the limit, miss overhead); a local model from SERVING_MODEL_DIR if set
# Two venvs, as deployed: vLLM + the client, and the daemon (no vLLM), sharing uv's wheel cache so the daemon's torch
# is vLLM's own wheel.   usage: vllm.sh WORK_DIR RESULTS_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
WORK=$1
RESULTS=$2
VLLM_VERSION=0.33.0
mkdir -p "$WORK" "$RESULTS"
export UV_CACHE_DIR="$WORK/uv-cache" UV_LINK_MODE=hardlink
step() { echo "[$((SECONDS))s] $*"; }

[ -x "$WORK/uv/bin/uv" ] || { python3 -m venv "$WORK/uv" && "$WORK/uv/bin/pip" -q install uv; }
UV="$WORK/uv/bin/uv"
step "vLLM $VLLM_VERSION (CUDA wheel and its own dependencies) + the kvsidecar client"
[ -x "$WORK/vllm/bin/python" ] || "$UV" venv -q --python python3 "$WORK/vllm"
"$UV" pip install -q --python "$WORK/vllm/bin/python" "vllm==$VLLM_VERSION" pytest -e "$REPO/contract" -e "$REPO/client"
TORCH=$("$WORK/vllm/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
step "the daemon (FLAVOUR=cuda: mooncake-transfer-engine) with vLLM's torch $TORCH"
[ -x "$WORK/daemon/bin/python" ] || "$UV" venv -q --seed --python python3 "$WORK/daemon"
"$UV" pip install -q --python "$WORK/daemon/bin/python" "torch==$TORCH"
VENV="$WORK/daemon" FLAVOUR=cuda bash scripts/setup.sh

export KVSIDECAR_PYTHON="$WORK/daemon/bin/python" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  VLLM_CACHE_ROOT="$WORK/cache/vllm" HF_HOME="$WORK/cache/hf" XDG_CACHE_HOME="$WORK/cache/xdg"
step "inference: cold, warm and noisy passes"
PYTHONPATH="$REPO/tests/vllm_real:$REPO/tests/vllm_connector" \
  "$WORK/vllm/bin/python" scripts/gpu/vllm_inference.py "$WORK/run"
step "layouts: every vLLM KV layout on CUDA"
PYTHONPATH="$REPO/contract:$REPO/client" KVSIDECAR_TEST_DEVICE=cuda KVSIDECAR_BIN="$WORK/daemon/bin/kvsidecar" \
  "$WORK/vllm/bin/python" -m pytest tests/vllm_connector/test_layouts.py -q -rs -p no:cacheprovider
step "serving: benchmarks/serving.py --preset gpu"
args=(--preset gpu --device cuda --out "$RESULTS/serving-vllm" --work "$WORK/serving")
if [ -n "${SERVING_MODEL_DIR:-}" ]; then
  args+=(--model-dir "$SERVING_MODEL_DIR")
fi
"$WORK/vllm/bin/python" benchmarks/serving.py "${args[@]}"
echo "PASS: vLLM's warm answers equal its cold ones, every layout round-tripped; serving results in $RESULTS/serving-vllm"
