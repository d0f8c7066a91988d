"""The `kvsidecar` command: one module per subcommand (serve, status, retention, layout, hash-token, demo, bench).

Imports: config, errors, daemon, rpc, tenancy, testing; grpc, torch (the demo's ranks), uvloop.
"""
