#!/usr/bin/env bash
# GPU check 30: the bench's data-path section on the GPU, `kvsidecar bench --quick --device cuda`: the KV cache of a
# rank on cuda:0, saved and loaded through the daemon (which maps it over CUDA IPC and moves it with the CUDA
# Mooncake build, FLAVOUR=cuda), against in-process Mooncake on the same GPU buffers and against a synchronized
# device-to-host copy into pinned host memory; every path's loaded bytes are compared with the saved ones on the GPU.
# Passes when the bench ran and verified every path; prints the headline rows (goal 1's ratios) as RESULT lines.
# The venv: 10-vllm-inference's daemon venv when it is there (CUDA torch + Mooncake CUDA build + the bench, as
# scripts/setup.sh installs it), else one of its own made the same way (uv, PyPI's CUDA torch, FLAVOUR=cuda).
#   BENCH_TORCH=version   torch for a venv of its own (default: the one 10-vllm-inference's vLLM uses, else 2.13.0)
#   BENCH_TIMEOUT_S=s     cap on the bench run (default 300)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=${GPU_CHECK_WORK:-/tmp/kvsidecar-gpu-check}
WORK=$ROOT/30-bench-cuda
OUT_DIR=$WORK/out
mkdir -p "$WORK"
step() { echo "[$((SECONDS))s] $*"; }
usable() { # a venv whose torch sees a GPU and which has Mooncake's CUDA build and the bench
  [ -x "$1/bin/kvsidecar" ] && "$1/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m, torch
assert torch.cuda.is_available()
m.version("mooncake-transfer-engine")
m.version("kvsidecar-bench")
PY
}

command -v nvidia-smi >/dev/null || { echo "FAIL: no nvidia-smi: this check needs a CUDA GPU"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

SHARED=$ROOT/10-vllm-inference/daemon
if usable "$SHARED"; then
  VENV=$SHARED
  step "reusing 10-vllm-inference's daemon venv $VENV"
else
  VENV=$WORK/venv
  export UV_CACHE_DIR="$ROOT/10-vllm-inference/uv-cache" UV_LINK_MODE=hardlink # torch's wheel, once
  mkdir -p "$UV_CACHE_DIR"
  [ -x "$WORK/uv/bin/uv" ] || { python3 -m venv "$WORK/uv" && "$WORK/uv/bin/pip" -q install uv; }
  UV="$WORK/uv/bin/uv"
  TORCH=${BENCH_TORCH:-}
  if [ -z "$TORCH" ] && [ -x "$ROOT/10-vllm-inference/vllm/bin/python" ]; then
    TORCH=$("$ROOT/10-vllm-inference/vllm/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
  fi
  TORCH=${TORCH:-2.13.0}
  step "a venv of its own: torch $TORCH from PyPI (its Linux wheels are CUDA builds)"
  [ -x "$VENV/bin/python" ] || "$UV" venv -q --seed --python python3 "$VENV"
  "$UV" pip install -q --python "$VENV/bin/python" "torch==$TORCH"
fi
step "the daemon, client and bench with Mooncake's CUDA build (scripts/setup.sh, FLAVOUR=cuda)"
VENV="$VENV" FLAVOUR=cuda bash scripts/setup.sh
"$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(), f"torch {torch.__version__} sees no GPU"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
  || { echo "FAIL: the venv's torch cannot use the GPU"; exit 1; }

step "kvsidecar bench --quick --device cuda --out $OUT_DIR"
rm -rf "$OUT_DIR"
rc=0
timeout "${BENCH_TIMEOUT_S:-300}" "$VENV/bin/kvsidecar" bench --quick --device cuda --no-progress --out "$OUT_DIR" || rc=$?
if [ "$rc" != 0 ]; then
  echo "FAIL: kvsidecar bench --quick --device cuda exited $rc (124: past ${BENCH_TIMEOUT_S:-300} s)"
  exit 1
fi

step "the report"
"$VENV/bin/python" - "$OUT_DIR/results.json" <<'PY'
import json, sys

doc = json.load(open(sys.argv[1]))
gpu = doc["machine"].get("gpu") or {}
print(f"RESULT gpu: {gpu.get('name')} driver {gpu.get('driver')} CUDA {gpu.get('cuda')}; paths {', '.join(doc['paths'])}")
for row in doc["headline"]:
    met = {True: "met", False: "NOT met", None: "-"}[row["met"]]
    value = "-" if row["value"] is None else f"{row['value']}{row['unit']}"
    print(f"RESULT {row['goal']} | {row['metric']} | {value} | target {row['target']} | {met}")
problems = []
if doc["settings"].get("device") != "cuda" or not gpu:
    problems.append("the report does not say it ran on a GPU")
if not doc["throughput"]:
    problems.append("no data-path results")
for shape in doc["throughput"]:
    bad = [p for p, ok in shape["verified"].items() if not ok] + [p for p in doc["paths"] if p not in shape["verified"]]
    if bad:
        problems.append(f"{shape['shape']}: bytes not verified for {', '.join(bad)}")
if problems:
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print(f"PASS: every path ({', '.join(doc['paths'])}) loaded the bytes it saved on cuda:0; report in {sys.argv[1]}")
PY
step "done"
