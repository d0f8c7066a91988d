"""The kvsidecar contract: what the daemon and its clients must agree on, in one copy.

The generated wire code (`proto`), the method table (`methods`: what each call carries and how it is run), the
limits and markers (`limits`), the group kinds on the wire (`kinds`), the default socket (`paths`) and the placement
rules themselves (`placement`, docs/placement.md). Depends on nothing but the
standard library and protobuf; the gRPC stubs (`proto.sidecar_pb2_grpc`) also need grpcio, which both sides have.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
