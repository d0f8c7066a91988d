"""The gRPC boundary, the only serving code that imports grpc: the servicer (unpack, call, reply), the wire
conversions, the one table from errors to status codes, credentials (TLS, tokens, tickets), the gRPC servers, the
side socket and the data socket (saves, loads and lookups without gRPC, answered by the same servicer).

Imports: config, errors, values, metrics, fence, store, tenancy, sessions, datapath; grpc.
"""
