"""The `kvsidecar` command: one module per subcommand (serve, status, retention, layout, hash-token), and demo and
bench, which hand over to the tools of their own distributions (handover.py).

Imports: config, errors, daemon, rpc, tenancy; grpc, uvloop.
"""
