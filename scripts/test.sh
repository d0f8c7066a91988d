#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, lint, type-check, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
V=.venv/bin
$V/ruff check .
$V/ruff format --check .
$V/mypy
$V/python -m pytest "$@"
