"""The daemon's own disk tier under --ssd-dir: append-only segment files, a checksummed index, write-behind.

Pure I/O: no grpc, no Mooncake. `DiskEngine` holds the files, `TieredStore` puts it behind a DRAM store.
"""

from kvsidecar.disk.engine import DiskEngine
from kvsidecar.disk.results import DiskStats, ReadResult, Recovery
from kvsidecar.disk.tiered import TieredStore

__all__ = ["DiskEngine", "DiskStats", "ReadResult", "Recovery", "TieredStore"]
