#!/usr/bin/env bash
# Builds, on a machine with PyPI and Debian's archive, everything the GPU check needs that a GPU machine without a
# registry lacks, into one folder of at most 60 MiB (default .gpu-wheelhouse, ignored by git): carry it over and run
# scripts/gpu-check.sh there. The GPU machine brings Python 3.12 with CUDA torch, transformers, numpy and pytest.
# The daemon's own wheels come at the versions its venv resolved (scripts/setup.sh first): it fails, saying so, when
# a version or a download is missing, rather than leave a wheelhouse the GPU machine cannot install from.
#   WHEELHOUSE=dir   where it goes (default .gpu-wheelhouse)
#   PYTHON_TAG=312   the GPU machine's CPython (cp312)
# Contents:
#   wheels/          grpcio, grpcio-health-checking, grpcio-reflection, protobuf, msgspec, pyzmq (the daemon's own
#                    needs that such an image lacks or has too old), as manylinux wheels for that Python
#   mooncake.tar.gz  Mooncake's CUDA build (mooncake-transfer-engine) cut to what the daemon loads: store.so,
#                    engine.so, libasio.so, the mooncake_master binary, the bundled .libs (98 MB wheel -> ~21 MB)
#   libs/            libcudart.so.12 (Mooncake's CUDA build links it; a CUDA 13 machine has only .so.13) and the
#                    Debian libraries Mooncake needs even over TCP (libibverbs, libmlx5, libnuma, libcurl and theirs);
#                    the install copies only those the machine lacks (ldd says which)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${WHEELHOUSE:-.gpu-wheelhouse}
TAG=${PYTHON_TAG:-312}
MOONCAKE=0.3.13.post1
PY=${PY:-.venv/bin/python}
command -v "$PY" >/dev/null || { echo "wheelhouse: no $PY: run scripts/setup.sh first (the wheels take its venv's versions)" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/libs"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
  manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
download() {
  local log
  log=$("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TAG" --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}" 2>&1) || {
    grep -v "is ignored: it is neither" <<<"$log" >&2
    echo "wheelhouse: pip download failed for ${*:2}" >&2
    exit 1
  }
}

# The daemon's Python needs, at the versions its own venv resolved (so the GPU check runs what CI tested).
needs=(grpcio grpcio-health-checking grpcio-reflection protobuf msgspec pyzmq)
pins=()
for name in "${needs[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null) || {
    echo "wheelhouse: $PY has no $name: run scripts/setup.sh first (the wheels take its venv's versions)" >&2
    exit 1
  }
  pins+=("$name==$v")
done
download "$OUT/wheels" "${pins[@]}"
for name in "${needs[@]}"; do
  compgen -G "$OUT/wheels/${name//-/_}-*.whl" >/dev/null || { echo "wheelhouse: no wheel of $name came" >&2; exit 1; }
done

# Mooncake's CUDA build, without what the daemon never loads (process group, EP, bench, the real client).
download "$tmp" "mooncake-transfer-engine==$MOONCAKE" nvidia-cuda-runtime-cu12
mkdir -p "$tmp/mc"
(cd "$tmp/mc" && unzip -q "$tmp"/mooncake_transfer_engine-*.whl)
keep_py='__init__.py buffer_pool.py cli.py'
(
  cd "$tmp/mc/mooncake"
  for f in *; do
    case " store.so engine.so libasio.so mooncake_master $keep_py " in
      *" $f "*) ;;
      *) rm -rf "$f" ;;
    esac
  done
)
# libetcd_wrapper.so is a 22 MB copy of the bundled one: the install links it instead. The dist-info stays, so that
# the bench finds which Mooncake build is installed.
(cd "$tmp/mc" && tar -czf - mooncake mooncake_transfer_engine.libs mooncake_transfer_engine-*.dist-info) >"$OUT/mooncake.tar.gz"
(cd "$tmp" && unzip -q -o nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d cudart)
cp "$tmp/cudart/nvidia/cuda_runtime/lib/libcudart.so.12" "$OUT/libs/"

# Debian's libraries (and what they link), unpacked; the install takes only what the machine lacks.
debs="libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14 librtmp1 \
  libssh2-1 libpsl5 libldap-2.5-0 libsasl2-2 libbrotli1 libidn2-0 libunistring2 libgssapi-krb5-2 libkrb5-3 \
  libk5crypto3 libkrb5support0 libkeyutils1 libgnutls30 libhogweed6 libnettle8 libtasn1-6 libp11-kit0 libffi8"
mkdir -p "$tmp/debs" "$tmp/root"
# shellcheck disable=SC2086  # a list of package names
(cd "$tmp/debs" && apt-get download $debs >/dev/null 2>&1) || {
  apt-get update >/dev/null && (cd "$tmp/debs" && apt-get download $debs >/dev/null)
}
for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
find "$tmp/root" \( -name '*.so.*' -o -name '*.so' \) \( -type f -o -type l \) -path '*lib*' \
  -not -path '*/libibverbs/*' -exec cp -a {} "$OUT/libs/" \;
find "$OUT/libs" -xtype l -delete  # links into folders left behind
# libmlx5 is a provider libibverbs loads from its own folder; one copy on the library path is what Mooncake links.
cp -a "$tmp"/root/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5* "$OUT/libs/" 2>/dev/null || true

size=$(du -sm "$OUT" | cut -f1)
echo "wheelhouse: $OUT, ${size} MiB"
if [ "$size" -gt 60 ]; then
  echo "wheelhouse: ${size} MiB is over the 60 MiB a GPU machine's working tree allows for it" >&2
  exit 1
fi
