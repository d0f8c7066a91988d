#!/usr/bin/env bash
# Installs kvsidecar on a GPU machine with no package registry, from the folder scripts/gpu/wheelhouse.sh built
# elsewhere, into the machine's own Python (the one that holds CUDA torch): nothing is downloaded, nothing of the
# system is changed. Prints the environment to use (eval it): PYTHONPATH, PATH, LD_LIBRARY_PATH.
#   WHEELHOUSE=dir   the folder (default .gpu-wheelhouse)
#   GPU_SITE=dir     where it installs (default /tmp/kvsidecar-gpu/site)
#   PYTHON=python3   the interpreter with CUDA torch
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
WH=${WHEELHOUSE:-.gpu-wheelhouse}
SITE=${GPU_SITE:-/tmp/kvsidecar-gpu/site}
PY=${PYTHON:-python3}
[ -f "$WH/mooncake.tar.gz" ] || { echo "install-offline: no wheelhouse at $WH (run scripts/gpu/wheelhouse.sh where PyPI is reachable)" >&2; exit 2; }
mkdir -p "$SITE/bin" "$SITE/lib"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WH"/wheels/*.whl >&2
tar -xzf "$WH/mooncake.tar.gz" -C "$SITE"
wrapper=$(ls "$SITE"/mooncake_transfer_engine.libs/libetcd_wrapper-*.so)
ln -sf "$wrapper" "$SITE/mooncake/libetcd_wrapper.so"
ln -sf "$SITE/mooncake/mooncake_master" "$SITE/bin/mooncake_master"
# Only the libraries this machine lacks (its own, or CUDA's driver, always win), with what they need in turn.
missing() { LD_LIBRARY_PATH="$SITE/lib" ldd "$SITE/mooncake/store.so" "$SITE/mooncake/engine.so" "$SITE"/lib/*.so* 2>/dev/null \
  | awk '/not found/ {print $1}' | sort -u; }
for _ in 1 2 3 4 5; do
  added=0
  for lib in $(missing); do
    if [ -e "$WH/libs/$lib" ] && [ ! -e "$SITE/lib/$lib" ]; then
      cp -aL "$WH/libs/$lib" "$SITE/lib/$lib"
      added=1
    fi
  done
  [ "$added" = 1 ] || break
done
left=$(missing | tr '\n' ' ')
[ -z "$left" ] || echo "install-offline: still missing after the wheelhouse: $left (libcuda.so.1 comes with the driver)" >&2
echo "export PYTHONPATH=$SITE:$REPO:$REPO/contract:$REPO/client:$REPO/testing:$REPO/benchmarks\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export PATH=$SITE/bin:\$PATH"
echo "export LD_LIBRARY_PATH=$SITE/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
