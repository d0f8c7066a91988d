"""The old import path of the daemon process: it lives in `kvsidecar_testing.processes` (import it from there)."""

from kvsidecar_testing.processes import Daemon as DaemonProcess
from kvsidecar_testing.processes import StorageNode, free_port, stop_pid

__all__ = ["DaemonProcess", "StorageNode", "free_port", "stop_pid"]
