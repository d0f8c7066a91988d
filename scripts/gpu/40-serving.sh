#!/usr/bin/env bash
# GPU check 40: the end-to-end serving bench (benchmarks/serving.py --preset gpu --device cuda) on one GPU: real
# vLLM 0.33 engines through a real daemon (KV over CUDA IPC, Mooncake's CUDA build): cold prefill on engine A, the
# same prompts from the store on a fresh engine B (greedy tokens equal to A's), vLLM's own prefix cache on engine C
# (no connector) as the limit, miss overhead (fresh prompts, A against C), and the OpenAI server with 16 concurrent
# clients on a shared 8k-token system prompt (TTFT p50/p99, tokens/s; with the connector, without, restarted). Prompts of 2k-32k tokens on a
# random-weight Llama-like model (2048 hidden, 16 layers, GQA 16/8, bf16), or on a local model with weights when
# SERVING_MODEL_DIR names one. Passes when every warm answer equals its cold one; prints the ratios as RESULT lines;
# results (serving.json, serving.md, serving.png) in $GPU_CHECK_WORK/40-serving/out: commit them as
# docs/benchmarks/serving-gpu.md.
# Uses 10-vllm-inference's venvs (vLLM + client, and the daemon's): run section 10 first (gpu-check.sh does).
#   SERVING_MODEL_DIR=path   a local Hugging Face model directory (config.json and weights) instead of random weights
#   SERVING_TIMEOUT_S=s      cap on the bench run (default 600)
#   SERVING_SKIP_SERVER=1    leave out the OpenAI-server passes (three server starts)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
ROOT=${GPU_CHECK_WORK:-/tmp/kvsidecar-gpu-check}
WORK=$ROOT/40-serving
OUT_DIR=$WORK/out
VLLM_VENV=$ROOT/10-vllm-inference/vllm
DAEMON_VENV=$ROOT/10-vllm-inference/daemon
mkdir -p "$WORK"
step() { echo "[$((SECONDS))s] $*"; }

command -v nvidia-smi >/dev/null || { echo "FAIL: no nvidia-smi: this check needs a CUDA GPU"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
if [ ! -x "$VLLM_VENV/bin/python" ] || [ ! -x "$DAEMON_VENV/bin/kvsidecar" ]; then
  echo "FAIL: 10-vllm-inference's venvs are missing ($VLLM_VENV, $DAEMON_VENV): run that section first"
  exit 2
fi
"$VLLM_VENV/bin/python" - <<'PY' || { echo "FAIL: the vLLM venv cannot see a GPU or lacks vLLM/the client"; exit 1; }
import importlib.metadata as m
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no GPU"
print("vllm", m.version("vllm"), "torch", torch.__version__, torch.cuda.get_device_name(0))
import kvsidecar_client.vllm  # noqa: F401
PY

args=(--preset gpu --device cuda --out "$OUT_DIR" --work "$WORK/run")
if [ -n "${SERVING_MODEL_DIR:-}" ]; then
  [ -f "$SERVING_MODEL_DIR/config.json" ] || { echo "FAIL: SERVING_MODEL_DIR=$SERVING_MODEL_DIR has no config.json"; exit 2; }
  args+=(--model-dir "$SERVING_MODEL_DIR")
  step "local model $SERVING_MODEL_DIR"
fi
[ -n "${SERVING_SKIP_SERVER:-}" ] && args+=(--skip-server)

step "benchmarks/serving.py ${args[*]}"
rm -rf "$OUT_DIR"
export KVSIDECAR_PYTHON="$DAEMON_VENV/bin/python"
rc=0
timeout "${SERVING_TIMEOUT_S:-600}" "$VLLM_VENV/bin/python" "$REPO/benchmarks/serving.py" "${args[@]}" || rc=$?
if [ "$rc" != 0 ]; then
  echo "FAIL: benchmarks/serving.py exited $rc (1: a warm answer differed from its cold one; 124: past ${SERVING_TIMEOUT_S:-600} s)"
  exit 1
fi
echo "PASS: warm answers equal cold ones; results in $OUT_DIR"
