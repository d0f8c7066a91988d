#!/usr/bin/env bash
# Sets up a virtual environment with the daemon, its client and the test tools.
# Idempotent: a second run only checks what is already there.
#   VENV=path     where the environment goes (default .venv in the repo)
#   FLAVOUR=cpu   Mooncake build: cpu (mooncake-transfer-engine-non-cuda) or cuda
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FLAVOUR=${FLAVOUR:-cpu}
PY=${PYTHON:-python3}

# Mooncake's native libraries need libibverbs (even for TCP), libnuma and libcurl. With root, take the Debian
# packages; without, unpack libibverbs into the venv, where kvsidecar finds it (kvsidecar/store/native.py).
has_lib() { ldconfig -p 2>/dev/null | grep -q "$1 "; }
need_ibverbs() { ! has_lib libibverbs.so.1; }
if need_ibverbs || ! has_lib libnuma.so.1 || ! has_lib libcurl.so.4; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 >/dev/null 2>&1 \
      || { apt-get update >/dev/null && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 >/dev/null; }
  fi
fi

# tests/cluster simulates nodes in network namespaces on a bridge (`ip`, as root; skipped otherwise).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v ip >/dev/null; then
  apt-get install -y --no-install-recommends iproute2 >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends iproute2 >/dev/null; }
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q "$@"; }

if need_ibverbs && [ ! -e "$VENV/lib/kvsidecar-native/libibverbs.so.1" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null)
  mkdir -p "$VENV/lib/kvsidecar-native"
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  find "$tmp/root" -name '*.so*' -exec cp -a {} "$VENV/lib/kvsidecar-native/" \;
  rm -rf "$tmp"
fi

# The CPU torch wheel first, so the daemon's torch>=2.4 is already satisfied and pip pulls no CUDA packages.
"$VENV/bin/python" -c 'import torch' 2>/dev/null || pip install "torch==2.13.0"
# The bench is a distribution of its own (benchmarks/): it measures the installed daemon from outside.
pip install -e ./contract -e ./client -e ".[$FLAVOUR,test]" -e ./benchmarks
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import kvsidecar; print(kvsidecar.__version__)'))"
