"""What each tier holds and serves: the disk tier under --ssd-dir (its directory, owner lock and Mooncake's offload
settings), and the gauges and hit counts of memory and disk.

Imports: config, errors, metrics, store.
"""
