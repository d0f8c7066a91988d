#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, lint, type-check, run the whole suite, then the vLLM connector
# against the real vLLM in a venv of its own (vLLM pins its own versions; ~2.2 GB, built once by setup-vllm.sh).
#   KVSIDECAR_SKIP_VLLM=1  skip the vLLM part (for quick local iterations; CI always runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
V=.venv/bin
$V/ruff check .
$V/ruff format --check .
$V/mypy
$V/python -m pytest --ignore=tests/vllm_connector "$@"
if [ "${KVSIDECAR_SKIP_VLLM:-0}" != 1 ]; then
  bash scripts/setup-vllm.sh
  .venv-vllm/bin/python -m pytest tests/vllm_connector -p no:cacheprovider
fi
