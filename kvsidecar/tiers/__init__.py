"""The disk tier under --ssd-dir, the daemon's own: append-only segment files written behind every save, an index
with a checksum per record, reads straight into engine memory (engine: what callers ask; index: the index, files and
queue under one lock; writer: the thread that writes the queue out; files, records, results), the files as a set
counted in bytes against the capacity (segments), a filesystem that refuses writes told once (writing), recovery that
rebuilds the index and cuts a torn tail (recovery); the store that puts it behind the DRAM one (tiered); the daemon's
side of it: the directory's owner lock, recovery in the log and `status`, the tier gauges and hit counts (node,
directory, holdings).

No listener: the daemon reads its own disk, so the fence admits nobody with a disk tier (docs/ssd-tier.md).

Imports: errors, parsing, metrics, store.
"""
