#!/usr/bin/env bash
# The GPU check, one harness for every machine with a CUDA GPU (CI has none), meant to run as one call.
# How it installs the daemon (GPU_CHECK_INSTALL, default: offline where .gpu-wheelhouse exists, else registry):
#   offline   a machine that reaches no package registry (a lent GPU machine): scripts/gpu/install-offline.sh puts
#             the daemon into the machine's own Python (the one with CUDA torch) from the wheelhouse that
#             scripts/gpu/wheelhouse.sh built where PyPI is reachable, carried over with the checkout
#   registry  PyPI reachable: FLAVOUR=cuda scripts/setup.sh into $GPU_CHECK_WORK/venv over the machine's CUDA torch
#   here      the daemon as already installed for $PYTHON (default .venv/bin/python): a dry run of the harness on CPU
# Sections (GPU_CHECK_ONLY, default "path bench serving"), each with its log, a time limit, and every process it
# started ended with it (they carry KVSIDECAR_GPU_CHECK=<run>:<section> in their environment, daemons and masters of
# their own session included):
#   path     pytest tests/gpu: CUDA memory through a real daemon (GQA, MLA, hybrid round trips through staging
#            rounds, partial loads, registration of 8 and 64 GiB in <= 1 s, a killed rank's memory back within the
#            lease + 1 s) and Mooncake's save copies from device memory against the alternatives (item 1)
#   bench    kvsidecar bench --quick --device cuda: the daemon against the GPU's gather+DMA limit on the same blocks,
#            8-256 blocks, MLA, GQA and GQA at TP=8; fails unless every path's bytes were verified
#   serving  scripts/gpu/serving_limit.py: a 4096-token prefix's prefill against its load through the daemon
#   vllm     registry only (vLLM's CUDA wheel is several GB): scripts/gpu/vllm.sh, real vLLM 0.33 through the daemon
# OUT (default /tmp/kvsidecar-gpu-check) receives two files, whatever ran: summary.txt (what this prints) and
# check.tar.gz (every log and result); a lent machine hands back at most 8. Exit 0 only when every section passed.
# GPU_CHECK_LIMIT=s caps every section at s seconds instead of its own limit (dry runs).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/kvsidecar-gpu-check}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/kvsidecar-gpu-work.XXXXXX)}
ONLY=${GPU_CHECK_ONLY:-path bench serving}
INSTALL=${GPU_CHECK_INSTALL:-$([ -f "${WHEELHOUSE:-.gpu-wheelhouse}/mooncake.tar.gz" ] && echo offline || echo registry)}
RUN=$$-$(date +%s)
mkdir -p "$OUT" "$WORK/results"
summary=$OUT/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
start=$SECONDS

finish() {
  tar -czf "$OUT/check.tar.gz" -C "$WORK" results 2>/dev/null || say "gpu-check: could not archive $WORK/results"
}
trap finish EXIT

# Every process of a section carries its marker: end them all (daemons start sessions of their own).
reap() {
  local marker="KVSIDECAR_GPU_CHECK=$RUN:$1" p pid what
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = "$$" ] && continue
    if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$marker"; then
      what=$({ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | cut -c1-100)
      kill -9 "$pid" 2>/dev/null && echo "gpu-check: ended $pid ($what), left running by $1"
    fi
  done
}

say "gpu-check: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
case "$INSTALL" in
  offline)
    env_lines=$(bash scripts/gpu/install-offline.sh 2>"$WORK/results/install.log") || {
      say "FAIL install (offline): $(tail -n 5 "$WORK/results/install.log")"
      exit 1
    }
    eval "$env_lines"
    PY=python3
    ;;
  registry)
    # The machine's own CUDA torch, seen from a venv of the check's (setup.sh installs no torch over it).
    [ -x "$WORK/venv/bin/python" ] || python3 -m venv --system-site-packages "$WORK/venv"
    VENV="$WORK/venv" FLAVOUR=cuda bash scripts/setup.sh >"$WORK/results/install.log" 2>&1 || {
      say "FAIL install (registry): $(tail -n 5 "$WORK/results/install.log")"
      exit 1
    }
    PY=$WORK/venv/bin/python
    export PATH="$WORK/venv/bin:$PATH"
    ;;
  here)
    PY=${PYTHON:-.venv/bin/python}
    ;;
  *)
    say "gpu-check: GPU_CHECK_INSTALL must be offline, registry or here, got $INSTALL"
    exit 2
    ;;
esac
export PYTHONUNBUFFERED=1
"$PY" - <<'PY' 2>&1 | tee -a "$summary"
import time
t0 = time.perf_counter()
import grpc, mooncake.store, torch
import kvsidecar
from kvsidecar.store.build import installed_build
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"install: torch {torch.__version__} CUDA {torch.version.cuda} on {gpu}, "
      f"grpc {grpc.__version__}, kvsidecar {kvsidecar.__version__}, {installed_build().describe()}, "
      f"imports {time.perf_counter() - t0:.1f} s")
PY
say "install ($INSTALL): $((SECONDS - start)) s"

failed=0
section() { # name, time limit (s), command...
  local name=$1 limit=${GPU_CHECK_LIMIT:-$2}
  shift 2
  case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS rc=0 log="$WORK/results/$name.log"
  KVSIDECAR_GPU_CHECK="$RUN:$name" timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
  reap "$name" >>"$log"
  if [ "$rc" = 0 ]; then
    say "PASS $name in $((SECONDS - t0)) s"
  else
    failed=$((failed + 1))
    say "FAIL $name (exit $rc$([ "$rc" = 124 ] && echo ": past ${limit} s")) in $((SECONDS - t0)) s"
    tail -n 30 "$log" | tee -a "$summary"
  fi
  grep -E '^RESULT|^\| ' "$log" | grep -vE '^\| (---|path|shape)' | head -60 | tee -a "$summary"
}

bench() {
  "$PY" -m kvsidecar_bench --quick --device cuda --sections throughput --no-real-client --no-progress \
    --out "$WORK/results/bench" && "$PY" scripts/gpu/bench_report.py "$WORK/results/bench/results.json"
}

section path 200 "$PY" -m pytest tests/gpu -q -s -p no:cacheprovider
section bench 170 bench
section serving 130 "$PY" scripts/gpu/serving_limit.py --out "$WORK/results/serving.json"
if [ "$INSTALL" = registry ]; then
  section vllm 540 bash scripts/gpu/vllm.sh "$WORK/vllm" "$WORK/results"
elif case " $ONLY " in *" vllm "*) true ;; *) false ;; esac; then
  say "SKIP vllm: it installs vLLM's CUDA wheel from PyPI (GPU_CHECK_INSTALL=registry)"
fi
say "gpu-check: $failed failed, $((SECONDS - start)) s; every log and result in $OUT/check.tar.gz"
[ "$failed" = 0 ]
