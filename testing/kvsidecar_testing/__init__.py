"""kvsidecar-testing: real parts for the tests, the bench and the demo, started for real; not in the daemon's wheel.

- `processes`: the daemon and a Mooncake storage node as processes on free ports, stopped by PID
- `mooncake_env`: Mooncake's environment and a private temporary folder for what its processes leave
- `waiting`: a clock and a backoff, so nothing sleeps on wall time to reach a state
- `ranks`: the one driver of an engine rank in its own process, over a pipe
- `oracle`: what an engine rank's blocks hold and what a load must bring back, from the engine's side
- `hashes`: block hashes chained as an engine chains them
- `states`: a recurrent layer's whole-model state and each TP rank's page of it, as vLLM slices it (rule 12)
- `demo`: `kvsidecar demo` (the `kvsidecar-demo` command): the main job in one command, checked byte for byte

The embedded master is the daemon's own (`kvsidecar.daemon.master.EmbeddedMaster`). Nothing here needs vLLM;
`processes`, `mooncake_env` and `waiting` need only the standard library, so a venv without the daemon can drive one
(the vLLM and SGLang suites import them from the checkout). The daemon imports nothing of this package: `kvsidecar
demo` hands its arguments to the `kvsidecar-demo` command, as `kvsidecar bench` does to `kvsidecar-bench`.
"""
