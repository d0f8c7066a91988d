#!/usr/bin/env bash
# GPU check 20: every KVCacheLayout vLLM 0.33 allocates, as CUDA tensors made by vLLM's own allocate_kv_cache on the
# GPU, registered by the connector over CUDA IPC and round-tripped byte for byte through a real daemon (real
# mooncake_master): tests/vllm_connector/test_layouts.py with KVSIDECAR_TEST_DEVICE=cuda.
#
# Standalone:  bash scripts/gpu/20-layouts.sh [extra pytest args]   (scripts/gpu-check.sh runs scripts/gpu/*.sh in order)
# Needs, on the GPU machine (nothing is installed here: the machine may have no network):
#   VLLM_PY   a python with vLLM 0.33 built for CUDA and its CUDA torch (default: .venv-vllm-cuda/bin/python)
#   .venv     the daemon's venv (scripts/setup.sh) whose torch sees the GPU: the daemon opens the CUDA IPC handles
# Output: the pytest log on stdout and in ${OUT:-/tmp}/20-layouts.log; LAYOUTS_TIMEOUT_S caps pytest (default 540 s).
# Exit: 0 passed; 77 skipped, with the reason (no GPU, no CUDA vLLM 0.33, no CUDA daemon venv); else failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
VLLM_PY=${VLLM_PY:-.venv-vllm-cuda/bin/python}
LOG=${OUT:-/tmp}/20-layouts.log
skip() { echo "20-layouts: SKIPPED: $*" | tee "$LOG"; exit 77; }

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || skip "no NVIDIA GPU (nvidia-smi -L failed)"
[ -x "$VLLM_PY" ] || skip "no python with vLLM at $VLLM_PY (set VLLM_PY)"
version=$("$VLLM_PY" -c 'import torch, vllm; assert torch.cuda.is_available(), "torch sees no GPU"; print(vllm.__version__)' 2>&1 | tail -1)
case "$version" in
  0.33.*) ;;
  *) skip "$VLLM_PY: vLLM 0.33 with a CUDA torch is needed, got: $version" ;;
esac
[ -x .venv/bin/kvsidecar ] || skip "no daemon venv: run scripts/setup.sh"
.venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null \
  || skip "the daemon's .venv has no CUDA torch: it cannot open CUDA IPC handles"

echo "20-layouts: vLLM $version, $(nvidia-smi -L | head -1)"
PYTHONPATH="$PWD/contract:$PWD/client" KVSIDECAR_TEST_DEVICE=cuda KVSIDECAR_BIN="$PWD/.venv/bin/kvsidecar" \
  PYTHONUNBUFFERED=1 timeout "${LAYOUTS_TIMEOUT_S:-540}" "$VLLM_PY" -m pytest tests/vllm_connector/test_layouts.py -q -rs -p no:cacheprovider "$@" \
  2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
