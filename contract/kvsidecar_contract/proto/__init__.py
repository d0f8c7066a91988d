"""Generated code of proto/kvsidecar/v1/sidecar.proto (scripts/gen_proto.sh)."""
