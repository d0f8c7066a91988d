"""A bare Mooncake client with no fence, holding 32 known bytes in a registered buffer: the hole the fence closes.

`python exposed_client.py MASTER`: prints {"address", "ports"} once set up, then serves until stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import sys

from kvsidecar.fence import proctcp
from kvsidecar.store.native import ensure_native_libs

PATTERN = bytes(range(0xA0, 0xC0))


def main() -> None:
    ensure_native_libs()
    from mooncake.store import MooncakeDistributedStore

    before = {s.inode for s, _ in proctcp.listeners()}
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", sys.argv[1])
    assert rc == 0, f"setup returned {rc}"
    buffer = ctypes.create_string_buffer(PATTERN, 4096)
    address = ctypes.addressof(buffer)
    assert store.register_buffer(address, 4096) == 0
    ports = [s.local_port for s, _ in proctcp.listeners() if s.inode not in before]
    print(json.dumps({"address": address, "ports": ports}), flush=True)
    sys.stdin.read()
    store.close()


if __name__ == "__main__":
    main()
