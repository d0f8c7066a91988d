"""The daemon process: what each part is told (settings.py: the types, and the daemon's own defaults; config/ cuts
them from the command line), its lifecycle (every part built in order, stopped in reverse), its Unix socket paths
and their lock, what a start checks before it starts anything (preflight), the wait for its master, the stop
signals, the embedded mooncake_master it supervises, and systemd notification.

Imports: errors, parsing, metrics, fence, store, tenancy, sessions, datapath, tiers, events, movers, rpc; grpc,
prometheus_client.
"""
