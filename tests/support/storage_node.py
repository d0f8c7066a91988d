"""Mooncake's standalone storage node (`mooncake_client`): a segment that outlives any daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from support.processes import free_port, stop_pid


class StorageNode:
    """A `mooncake_client` process contributing a segment to a master, on loopback."""

    def __init__(self, master: str, workdir: Path, segment: str = "128MB") -> None:
        self.master = master
        self.port = free_port()
        self.segment = segment
        self.log_path = workdir / "storage-node.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StorageNode:
        binary = Path(sys.executable).parent / "mooncake_client"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), f"--master_server_address={self.master}", f"--global_segment_size={self.segment}",
                 "--local_buffer_size=16MB", "--host=127.0.0.1", f"--port={self.port}",
                 "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        time.sleep(1.5)  # it mounts its segment at the master during start-up
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_client exited: {self.log_path.read_text(errors='replace')}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)
