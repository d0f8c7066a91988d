"""The gRPC boundary, the only serving code that imports grpc: one handler per method of the contract's table
(handlers.py: unpack, call, reply), the one dispatcher that runs a call as its row says (dispatch.py: admit, gate,
slot, handler), the two ways in that hand it their calls (the gRPC servicer and the data socket: saves, loads and
lookups without gRPC), the wire conversions, the one table from errors to status codes, credentials (TLS, tokens,
tickets), the gRPC servers and the side socket.

Imports: errors, parsing, values, metrics, fence, store, tenancy, sessions, datapath; grpc.
"""
