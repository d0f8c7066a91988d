"""The daemon process: each part's settings cut from Config (the only room that reads it), its lifecycle (every part
built in order, stopped in reverse), its Unix socket paths and their lock, what a start checks before it starts
anything (preflight), the wait for its master, the stop signals, the embedded mooncake_master it supervises, and
systemd notification.

Imports: config, errors, metrics, fence, store, tenancy, sessions, datapath, tiers, events, movers, rpc; grpc,
prometheus_client.
"""
