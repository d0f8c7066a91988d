#!/usr/bin/env bash
# Regenerates the Python code of the wire contract (proto/) into the contract distribution, which the daemon
# and the client both depend on. tests/unit/test_proto_fresh.py fails when the committed code is stale.
#   OUT=dir  generate there instead (the freshness test uses this)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-contract/kvsidecar_contract/proto}
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m grpc_tools.protoc -Iproto --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  kvsidecar/v1/sidecar.proto
mkdir -p "$OUT"
# Generated imports are absolute (kvsidecar.v1); make them package-relative so the code lives anywhere.
sed -i 's/^from kvsidecar\.v1 import sidecar_pb2 as/from . import sidecar_pb2 as/' "$tmp/kvsidecar/v1/sidecar_pb2_grpc.py"
cp "$tmp"/kvsidecar/v1/sidecar_pb2.py "$tmp"/kvsidecar/v1/sidecar_pb2.pyi "$tmp"/kvsidecar/v1/sidecar_pb2_grpc.py "$OUT/"
[ -f "$OUT/__init__.py" ] || printf '"""Generated code of proto/kvsidecar/v1/sidecar.proto (scripts/gen_proto.sh)."""\n' >"$OUT/__init__.py"
