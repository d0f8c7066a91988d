"""The data socket's frames: Save, Load, their batches and Lookup as length-prefixed protobuf messages on a Unix
stream.

gRPC stays the control plane (sessions, registration, stats). An engine's saves, loads and lookups are small and
many, and a gRPC call costs 0.5-0.7 ms of round trip and several threads on each side; on the data socket a call is
one write and one read on a connection the client keeps, answered on the daemon thread that read it
(docs/benchmarks/perf-changes.md).

A connection starts with one HELLO frame that binds it to a session; every later frame is one call, answered by one
reply frame before the next request is read:

    request: REQUEST header (body length, method id, seconds left: 0 = no deadline), then the body
    reply:   REPLY header (body length, status: 0 = OK, else the gRPC status code number), then the body

The HELLO body is JSON {"session": id, "secret": hex of the session's side secret, "liveness": true (optional)}; its
reply's body is empty or the reason. A liveness connection keeps its session alive while it is open, however late
its KeepAlives come, and ends the session when it closes (the process exited or died); a client holds one per
session and sends no calls on it. Daemons older than this flag ignore it (the lease alone applies).

A call's body is the method's request message (the same protobuf as over gRPC); its reply's body is the response
message, or on failure the UTF-8 reason, the same code and reason the gRPC call would have answered.
Which methods the data socket carries, and under which number, is their row's (`methods`).
"""

from __future__ import annotations

import struct

from kvsidecar_contract.methods import BY_FRAME

__all__ = ["HELLO", "LIVENESS", "MAX_HELLO_BYTES", "METHODS", "METHOD_IDS", "OK", "REPLY", "REQUEST"]

REQUEST = struct.Struct("<IBd")
REPLY = struct.Struct("<IB")

HELLO = 0
OK = 0
MAX_HELLO_BYTES = 1024
LIVENESS = "liveness"  # the HELLO key that makes a connection its session's liveness

# The calls the data socket carries, by their number on the wire (read off the method table); every other method is
# gRPC's alone.
METHODS: dict[int, str] = {number: method.name for number, method in BY_FRAME.items()}
METHOD_IDS: dict[str, int] = {name: number for number, name in METHODS.items()}
