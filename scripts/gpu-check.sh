#!/usr/bin/env bash
# The checks that need a GPU (CI has none): runs every scripts/gpu/*.sh section in name order, each in its own log,
# and prints one PASS/FAIL block per section. Exit 0 only when every section passed. Meant for one H200 (or any
# CUDA GPU) in under 10 minutes from a cold start, with PyPI reachable; each section sets up its own venvs.
#   GPU_CHECK_WORK=dir   where venvs, models and logs go (default /tmp/kvsidecar-gpu-check); kept between runs
#   GPU_CHECK_ONLY=glob  run only the sections whose file name matches (e.g. '10-*')
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
WORK=${GPU_CHECK_WORK:-/tmp/kvsidecar-gpu-check}
ONLY=${GPU_CHECK_ONLY:-*}
mkdir -p "$WORK/logs"
export GPU_CHECK_WORK="$WORK"
start=$SECONDS
failed=0
ran=0
for section in scripts/gpu/*.sh; do
  name=$(basename "$section" .sh)
  # shellcheck disable=SC2254  # ONLY is a glob on purpose
  case "$(basename "$section")" in $ONLY) ;; *) continue ;; esac
  log="$WORK/logs/$name.log"
  t0=$SECONDS
  bash "$section" >"$log" 2>&1
  rc=$?
  ran=$((ran + 1))
  echo "======== $name: $([ "$rc" = 0 ] && echo PASS || echo "FAIL (exit $rc)") in $((SECONDS - t0)) s ========"
  if [ "$rc" = 0 ]; then
    grep -E '^(RESULT|PASS)' "$log" || true
  else
    failed=$((failed + 1))
    tail -n 40 "$log"
  fi
  echo "log: $log"
done
echo "gpu-check: $ran sections, $failed failed, $((SECONDS - start)) s"
[ "$ran" -gt 0 ] && [ "$failed" = 0 ]
