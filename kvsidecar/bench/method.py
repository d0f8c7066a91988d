"""How the bench measures, as the report explains it to its readers."""

METHOD = """
**One run, side by side.** The bench starts its own `mooncake_master`s (kvsidecar.master.EmbeddedMaster), the daemon
as a separate process (`python -m kvsidecar serve --master ... --socket <tmp>`, so every save and load really crosses
gRPC on a Unix socket into another process) and, where the wheel has one, Mooncake's `mooncake_client`. Every path
gets its own master and its own segment of the same size, so in each Mooncake cluster the only segment is the path's
own and every transfer takes Mooncake's local memcpy path; with one shared master Mooncake would place some of one
path's values in another path's segment, over TCP. Every process is stopped by PID at the end.

**Same buffers, same keys, same batches.** Engine memory is laid out as vLLM lays out its KV cache: one tensor per
layer (MLA) or per layer and K/V (GQA), dim 0 = blocks, in named shared memory, filled with a distinct pattern per
block. A request's blocks are saved from block ids 0..n-1 and loaded back into other blocks (n..2n-1), one batch per
request on every path, under the keys the daemon's placement code computes. *daemon* is the client library
(`SidecarClient.save(...).result()`, `load_detailed`); the lookup before each load is the scheduler's step and is not
timed (for the TP-8 shape, whose lookup needs all eight ranks' shards, the rank builds the full hit itself).
*in-process* is what vLLM's in-tree Mooncake store connector does inside the rank: a `MooncakeDistributedStore` with
its own segment, buffers registered once, keys from the same placement code, `batch_is_exist` and then
`batch_put_from_multi_buffers` of the missing values, `batch_get_into_multi_buffers` to load. *real-client* is the
same calls from a Mooncake dummy client, with `mooncake_client` owning the segment and moving the bytes; a dummy
client can only hand over buffers from its own shared-memory pool, so its engine memory is a byte-identical copy in
that pool. *memcpy* copies the same bytes with one core, one contiguous copy per tensor (torch): the bandwidth one
copy thread gets here, which is what one Mooncake batch uses. Before timing, every path's loaded bytes are compared
with the ones it saved.

**Warm and cold.** *Cold* rounds run first, for every shape: distinct requests saved without removing anything, so
each put lands in segment memory never written before and pays the kernel's first-touch page faults (memcpy: into
freshly mapped pages). A store with a large segment stays in this regime until the segment has filled once, which in
production can take hours. The daemon pre-faults its segment in the background when it starts
(MADV_POPULATE_WRITE, see kvsidecar/store/mooncake_store.py), so its cold puts cost what its warm ones do; its first
touches of a newly registered engine mapping are still in the cold numbers. In the *warm* rounds the same request is
saved, loaded and removed every round, so every store reuses segment memory it has touched before.

**Statistics.** Each point is the median over rounds (the first warm round is a warm-up and not recorded); paths
take turns within a round, in an order that rotates every round. CPU s/GiB adds the CPU time of every process on
the path (bench process, daemon or mooncake_client) over all rounds of the point; the Mooncake master's is not
counted. Lookup latencies are p50/p99 over repetitions that alternate daemon and raw check; *placement* is the
daemon's own planning code (probe keys, quorum, hit fixed point) timed in the bench process. The bench process runs
torch with one thread: on a shared 2-core machine a two-thread copy collapses whenever the other core is busy, and
idle OpenMP threads spin, stealing the core the daemon needs. The machine is shared with other work: ratios within a
run are meaningful, absolute numbers vary from run to run.
"""
