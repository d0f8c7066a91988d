"""kvsidecar: the node-local KV-cache store daemon.

Its rooms, lowest first; each may import only rooms below it (its docstring's `Imports:` line, checked by
tests/unit/daemon/test_layering.py), and the pure placement rules come from kvsidecar_contract:

- `errors`: every error family; `parsing`: a setting's text as its value (sizes, addresses)
- `store/`: the only code that touches Mooncake; `fence/`: the listener fence
- `events/`: KV events for routers
- `reasons`: why a block was not saved or loaded; `metrics`: every exported metric
- `values`: the domain values requests carry in and results carry out
- `memory/`: every address; `tenancy/`: credentials, rights, budgets
- `movers/`: how bytes move, one mover per session memory (host; GPU: staging, streams, the page-locked segment)
- `sessions/`: sessions and their leases; `tiers/`: the disk tier
- `datapath/`: save, lookup, load, reset against the store
- `rpc/`: the gRPC boundary; `daemon/`: the process
- `config/`: every setting, read from the flags and the file and cut into what each part is told
- `cli/`: the command line; `testing/`: real parts for tests, the demo and the bench

Imports: (the package itself holds only the version).
"""

__version__ = "0.1.0"
