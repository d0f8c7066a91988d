"""How a session's bytes move between its registered memory and the store: one mover per session memory, chosen
once when the memory is registered (factory), behind one small protocol (base.Mover: check, put, get, close), so
the data path plans and accounts and never asks where memory lies.

- host: host memory (memfds, /dev/shm), put from and read into the engine's blocks in place by the store;
- device: GPU memory, gathered into a staging slot and put from there, loaded by the daemon's own copies from the
  page-locked segment and scattered; its docstring states the ordering of events;
- plans: copy plans (strided views of a session's memory); staging: each device's slots (staging, bounce, index
  buffers, a stream each); accelerators: what differs between a GPU and a CPU standing in for one;
- runtime: on a GPU node, the Mooncake build checked, CUDA started in the background, the segment page-locked, the
  GPUs' UUIDs (identity: a rank's GPU found by UUID), the path's health;
- trailer: the 16 bytes every stored value ends with, and which values carry a checksum in them; sums: the
  checksums computed at save and checked at load, for both movers.

Imports: errors, reasons, values, metrics, store, memory; torch (only on a GPU node, or where tests stand a CPU in
for one).
"""
