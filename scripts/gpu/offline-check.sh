#!/usr/bin/env bash
# The GPU check in one call, on a GPU machine with no package registry (e.g. a lent H200): installs from the
# wheelhouse scripts/gpu/wheelhouse.sh built elsewhere (scripts/gpu/install-offline.sh), then runs, each with its own
# log and time limit:
#   path     scripts/gpu/tests: a fresh rank process loads every byte another saved (GQA, MLA, hybrid), values
#            missing from the store fail alone, CUDA registration of 8 and 64 GiB in <= 1 s, a rank killed -9 gives
#            its GPU memory back within the lease + 1 s
#   bench    kvsidecar bench --quick --device cuda: the daemon against the GPU's gather+DMA limit on the same
#            blocks, at 8-256 blocks, MLA, GQA and GQA at TP=8 (results.md/.json under $OUT/bench)
#   serving  scripts/gpu/serving_limit.py: a 4096-token prefix's prefill against its load through the daemon,
#            Llama-8B and 32B shapes
# Prints one PASS/FAIL line per section with its RESULT lines; exit 0 only when every section passed.
#   OUT=dir            where logs and results go (default /tmp/kvsidecar-gpu-check)
#   GPU_CHECK_ONLY=..  sections to run, e.g. "path bench" (default: all three)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/kvsidecar-gpu-check}
ONLY=${GPU_CHECK_ONLY:-path bench serving}
mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
env_lines=$(bash scripts/gpu/install-offline.sh 2>"$OUT/install.log") || {
  echo "FAIL install:"
  cat "$OUT/install.log"
  exit 1
}
eval "$env_lines"
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee -a "$OUT/install.log"
import time
t0 = time.perf_counter()
import grpc, mooncake.store, torch
import kvsidecar
print(f"install: torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name(0)}, "
      f"grpc {grpc.__version__}, kvsidecar {kvsidecar.__version__}, imports {time.perf_counter() - t0:.1f} s")
PY
echo "install: $((SECONDS - start)) s"
failed=0
section() { # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    echo "PASS $name in $((SECONDS - t0)) s"
  else
    failed=$((failed + 1))
    echo "FAIL $name (exit $rc$([ "$rc" = 124 ] && echo ": past ${limit} s")) in $((SECONDS - t0)) s"
    tail -n 30 "$OUT/$name.log"
  fi
  grep -E '^RESULT|^\| ' "$OUT/$name.log" | grep -vE '^\| (---|path|shape)' | head -60
}
section path 170 python3 -m pytest scripts/gpu/tests -q -s -p no:cacheprovider
section bench 170 python3 -m kvsidecar_bench --quick --device cuda --sections throughput --no-real-client \
  --no-progress --out "$OUT/bench"
section serving 130 python3 scripts/gpu/serving_limit.py --out "$OUT/serving.json"
echo "gpu-check: $failed failed, $((SECONDS - start)) s"
[ "$failed" = 0 ]
