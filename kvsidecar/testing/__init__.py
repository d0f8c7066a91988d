"""Test and bench support shipped with the daemon (as httpx ships its mock transport): real parts, started for real.

- `processes`: the daemon and a Mooncake storage node as processes on free ports, stopped by PID
- `mooncake_env`: Mooncake's environment and a private temporary folder for what its processes leave
- `waiting`: a clock and a backoff, so nothing sleeps on wall time to reach a state
- `ranks`: the one driver of an engine rank in its own process, over a pipe
- `oracle`: what an engine rank's blocks hold and what a load must bring back, from the engine's side
- `hashes`: block hashes chained as an engine chains them
- `states`: a recurrent layer's whole-model state and each TP rank's page of it, as vLLM slices it (rule 12)

The embedded master is the daemon's own (`kvsidecar.daemon.master.EmbeddedMaster`). Nothing here needs vLLM;
`processes`, `mooncake_env` and `waiting` need only the standard library, so a venv without the daemon can drive one.
Nothing of the daemon imports it but the demo.

Imports: errors, store, rpc; grpc.
"""
