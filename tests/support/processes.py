"""The old import path of the daemon process: it lives in `kvsidecar.testing.processes` (import it from there)."""

from kvsidecar.testing.processes import Daemon as DaemonProcess
from kvsidecar.testing.processes import StorageNode, free_port, stop_pid

__all__ = ["DaemonProcess", "StorageNode", "free_port", "stop_pid"]
