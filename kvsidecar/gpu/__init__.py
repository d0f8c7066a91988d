"""The GPU data path: a rank's CUDA KV cache moved with the GPU's copy engines, not one cudaMemcpy per slice.

- runtime: on a GPU node, the CUDA contexts started in the background when the daemon starts (so registration never
  waits for them), the store's segment page-locked once (so every copy of it is one DMA), and per device a staging
  area (staging.py);
- transfers: a save gathers the request's blocks on the GPU into staging (one kernel per run of slices) and puts
  each value from there; a load copies each value's replica in this node's segment host-to-device straight into
  staging (values elsewhere come through the store into a pinned bounce first) and scatters them into the blocks.

Measured on one H200 before this path existed (../docs/benchmarks/gpu.md): 1-2 GiB/s through Mooncake's per-slice
copies into pageable memory, 47-49 GB/s for one gather kernel plus one DMA.

Imports: errors, values, metrics, store, memory; torch (only on a GPU node, or where tests stand a CPU in for one).
"""
