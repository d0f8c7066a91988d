#!/usr/bin/env bash
# Sets up a virtual environment with the daemon, its client, the bench and the test tools, saying what it does.
# A second run only checks (seconds): $VENV/.setup-stamp holds the hashes of what the last set-up installed from (the
# four pyproject.toml files, this script), the flavour and the Python; it installs again only when one of them changed
# or a package is missing.
#   VENV=path     where the environment goes (default .venv in the repo)
#   FLAVOUR=cpu   Mooncake build: cpu (mooncake-transfer-engine-non-cuda) or cuda
#   --check       change nothing: exit 0 if the environment is up to date with this checkout, 1 (saying why) if not
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FLAVOUR=${FLAVOUR:-cpu}
PY=${PYTHON:-python3}
CHECK=0
[ "${1:-}" = --check ] && CHECK=1
say() { echo "setup: $*"; }

# What the set-up installs from: a change to any of these installs again.
stamp() {
  sha256sum pyproject.toml contract/pyproject.toml client/pyproject.toml benchmarks/pyproject.toml \
    testing/pyproject.toml scripts/setup.sh
  echo "flavour $FLAVOUR"
  echo "python $("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')"
}
# The modules the set-up provides; find_spec imports none of them, so this costs a few milliseconds.
missing_modules() {
  "$VENV/bin/python" -c 'import importlib.util as u
print(" ".join(m for m in ("kvsidecar", "kvsidecar_client", "kvsidecar_contract", "kvsidecar_bench", "kvsidecar_testing",
                           "torch", "mooncake", "pytest") if u.find_spec(m) is None))'
}
# Why the environment needs installing ("" when it is up to date).
outdated() {
  if [ ! -x "$VENV/bin/python" ]; then echo "no environment at $VENV yet"; return; fi
  if [ ! -f "$VENV/.setup-stamp" ]; then echo "first set-up of $VENV"; return; fi
  local changed missing
  # A differing line names its file (after its hash), or says flavour or python.
  changed=$(diff <(stamp) "$VENV/.setup-stamp" | awk '/^[<>]/ { print ($2 ~ /^[0-9a-f]+$/) ? $3 : $2 }' \
    | sort -u | paste -sd, - || true)
  missing=$(missing_modules)
  if [ -n "$changed" ]; then echo "changed since the last set-up: ${changed//,/, }"
  elif [ -n "$missing" ]; then echo "missing from $VENV: $missing"
  fi
}

# grep reads all of ldconfig's output: with -q it would leave at the first match, and under pipefail ldconfig's
# SIGPIPE would then make a library that is there look missing now and then.
has_lib() { ldconfig -p 2>/dev/null | grep -F "$1 " >/dev/null; }
need_ibverbs() { ! has_lib libibverbs.so.1; }
need_libs() { need_ibverbs || ! has_lib libnuma.so.1 || ! has_lib libcurl.so.4; }

if [ "$CHECK" = 1 ]; then
  why=$(outdated)
  if [ -n "$why" ]; then say "$VENV needs setting up: $why"; exit 1; fi
  say "$VENV is up to date with this checkout"
  exit 0
fi

# Mooncake's native libraries need libibverbs (even for TCP), libnuma and libcurl. With root, take the Debian
# packages; without, unpack libibverbs into the venv, where kvsidecar finds it (kvsidecar/store/native.py).
if need_libs && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "installing libibverbs1, libnuma1 and libcurl4 (Debian packages Mooncake's wheel needs)"
  apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 >/dev/null; }
fi

# tests/cluster simulates nodes in network namespaces on a bridge (`ip`, as root; skipped otherwise).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v ip >/dev/null; then
  say "installing iproute2 (tests/cluster's network namespaces)"
  apt-get install -y --no-install-recommends iproute2 >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends iproute2 >/dev/null; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip -q "$@"; }

if need_ibverbs && [ ! -e "$VENV/lib/kvsidecar-native/libibverbs.so.1" ]; then
  say "unpacking libibverbs into $VENV/lib/kvsidecar-native (not root: no system packages)"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null)
  mkdir -p "$VENV/lib/kvsidecar-native"
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  find "$tmp/root" -name '*.so*' -exec cp -a {} "$VENV/lib/kvsidecar-native/" \;
  rm -rf "$tmp"
fi

why=$(outdated)
if [ -n "$why" ]; then
  say "installing: $why"
  # The CPU torch wheel first, so the daemon's torch>=2.4 is already satisfied and pip pulls no CUDA packages.
  if ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; then
    say "installing torch 2.13.0 (the CPU build where the index has it: a wheel of about 180 MB)"
    pip install "torch==2.13.0"
  fi
  # The bench (benchmarks/) and the test machinery with the demo (testing/) are distributions of their own: they
  # drive the installed daemon from outside, and its wheel carries neither.
  say "installing kvsidecar, its contract, client, test machinery and bench (editable), Mooncake ($FLAVOUR) and the test tools"
  pip install -e ./contract -e ./client -e ".[$FLAVOUR,test]" -e ./testing -e ./benchmarks
  stamp >"$VENV/.setup-stamp"
else
  say "$VENV is up to date with this checkout (nothing to install)"
fi
say "$VENV ready ($("$VENV/bin/python" -c 'import kvsidecar; print(kvsidecar.__version__)'))"
