"""KV events for prefix-aware routers: what this node's store holds, in vLLM's `kv_events` wire format over ZeroMQ.

messages (the event values and their msgpack encoding), publisher (the PUB/replay sockets and their thread), blocks
(a save's written values as BlockStored events), feed (what the data path calls), sweep (evictions made visible),
endpoints (which addresses may be bound), node (all of it for one daemon). See docs/kv-events.md.

Imports: errors, fence (which hosts are loopback); prometheus_client.
"""
