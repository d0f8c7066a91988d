"""The `kvsidecar` command: one module per subcommand (serve, status, layout, hash-token, demo, bench).

Imports: config, errors, daemon, rpc, tenancy, testing; grpc, torch (the demo's ranks), uvloop.
"""
