"""Mooncake's TCP transfer protocol with no credentials: connect, send one 24-byte READ header, report what comes back.

Run inside a namespace: `python rawprobe.py ADDRESS SIZE HOST:PORT...`; prints one JSON object per target.
The header is Mooncake's SessionHeader (tcp_transport_session_impl.h): uint64 size, uint64 addr, uint8 opcode,
padded to 24 bytes, little-endian; opcode 0 is TransferRequest::READ in the legacy (unacknowledged) framing, to
which the server answers with `size` raw bytes of its memory at `addr`.
"""

from __future__ import annotations

import json
import socket
import struct
import sys

READ = 0
HEADER = struct.Struct("<QQB7x")
assert HEADER.size == 24


def probe(host: str, port: int, address: int, size: int, timeout: float) -> dict[str, object]:
    result: dict[str, object] = {"target": f"{host}:{port}", "bytes": ""}
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        result["outcome"] = "connect timed out"
        return result
    except OSError as exc:
        result["outcome"] = f"connect failed: {exc.strerror}"
        return result
    with conn:
        result["outcome"] = "connected"
        try:
            conn.sendall(HEADER.pack(size, address, READ))
            data = b""
            while len(data) < size:
                chunk = conn.recv(size - len(data))
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            result["outcome"] = f"connected, then {exc.__class__.__name__}"
            data = b""
        result["bytes"] = data.hex()
    return result


def main() -> None:
    address, size = int(sys.argv[1], 0), int(sys.argv[2])
    for target in sys.argv[3:]:
        host, _, port = target.rpartition(":")
        print(json.dumps(probe(host.strip("[]"), int(port), address, size, timeout=3.0)), flush=True)


if __name__ == "__main__":
    main()
