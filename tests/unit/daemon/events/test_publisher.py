"""The KV-event publisher over real ZeroMQ sockets: vLLM's framing, per-topic sequences, replay, drops, no blocking."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvsidecar.events.messages import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from kvsidecar.events.publisher import Publisher, PublisherError
from support.kv_subscriber import KvSubscriber, stored_hashes

DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


@pytest.fixture
def publisher():
    registry = CollectorRegistry()
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", base_topic="kv", registry=registry)
    p.start()
    yield p
    p.stop()


def count(p: Publisher, name: str) -> float:
    return {"messages": p.messages, "events": p.events, "dropped": p.dropped, "replays": p.replays}[name]._value.get()


def test_a_batch_is_an_array_and_its_events_tagged_maps_without_their_defaults():
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.5, events=[stored(b"h"), AllBlocksCleared()])))
    assert raw[0] == 1.5
    assert raw[1][1] == {"type": "AllBlocksCleared"}
    assert raw[1][0]["type"] == "BlockStored"
    assert raw[1][0]["block_hashes"] == [b"h"]
    assert "extra_keys" not in raw[1][0]  # a default: left out, as vLLM's encoder leaves it out
    assert raw[2:] in ([], [None])  # data_parallel_rank unset


def test_subscribers_get_each_topic_in_order_with_its_own_sequence(publisher):
    a = KvSubscriber(publisher.address, publisher.replay_address, "kv", DECODE)
    b = KvSubscriber(publisher.address, publisher.replay_address, "kv.team-a", DECODE)
    try:
        publisher.publish("kv", [stored(b"1")])
        publisher.publish("kv.team-a", [stored(b"x")])
        publisher.publish("kv", [stored(b"2", b"3"), BlockRemoved(block_hashes=[b"1"], medium=MEDIUM_CPU)])
        assert publisher.flush(30)
        got = a.collect(lambda bs: len(stored_hashes(bs)) >= 3)
        assert stored_hashes(got) == [b"1", b"2", b"3"]
        assert stored_hashes(b.collect(lambda bs: len(bs) >= 1)) == [b"x"]
        # Its own sequence: team-a's first message is its seq 0, whatever the base topic sent before.
        assert b.expected == 1
        # Once subscribed, messages come live; the sequence goes on from where the replays left it.
        for n in range(50):
            publisher.publish("kv", [stored(bytes([n]))])
            if a.collect(lambda bs: len(bs) >= 1) and a.live:
                break
        assert a.live >= 1
    finally:
        a.close()
        b.close()


def test_a_replay_without_a_topic_is_vllms_request_for_the_base_topic(publisher):
    # Flushed one by one: events queued together go out as one message per topic.
    for topic, h in (("kv", b"1"), ("kv.other", b"o"), ("kv", b"2")):
        publisher.publish(topic, [stored(h)])
        assert publisher.flush(30)
    sub = KvSubscriber(publisher.address, publisher.replay_address, "kv", DECODE)
    try:
        base = sub.replay(1)
        assert [(topic, seq) for topic, seq, _ in base] == [(b"kv", 1)]
        assert stored_hashes([DECODE(base[0][2])]) == [b"2"]
        other = sub.replay(0, "kv.other")
        assert [(topic, seq) for topic, seq, _ in other] == [(b"kv.other", 0)]
        assert sub.replay(0, "kv.nobody") == []
        assert count(publisher, "replays") == 3
    finally:
        sub.close()


def test_a_full_queue_drops_counts_and_clears_the_topic_first():
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", base_topic="kv", queue_weight=4)
    # Not started: nothing drains the queue, so the third event (a hash each: weight 2) finds it full.
    p.publish("kv", [stored(b"1"), stored(b"2")])
    p.publish("kv", [stored(b"3")])
    assert count(p, "dropped") == 1
    p.start()
    sub = KvSubscriber(p.address, p.replay_address, "kv", DECODE)
    try:
        assert p.flush(30)
        (batch,) = sub.collect(lambda bs: len(bs) >= 1)
        # A subscriber cannot keep a view that misses the dropped event: it is told to forget everything first.
        assert [type(e).__name__ for e in batch.events] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    finally:
        sub.close()
        p.stop()


def test_a_subscriber_that_never_reads_never_holds_the_publisher_up():
    p = Publisher("tcp://127.0.0.1:0", base_topic="kv", hwm=10)
    p.start()
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt_string(zmq.SUBSCRIBE, "")
    stuck.connect(p.address)
    try:
        for n in range(2_000):
            p.publish("kv", [stored(n.to_bytes(4, "big")) for _ in range(8)])
        assert p.flush(60)  # everything left the queue: ZeroMQ dropped for the stuck subscriber, not we
        assert count(p, "dropped") == 0
        assert count(p, "events") == 16_000
    finally:
        stuck.close(linger=0)
        ctx.term()
        p.stop()


def test_an_address_in_use_is_a_publisher_error(publisher):
    other = Publisher(publisher.address)
    with pytest.raises(PublisherError, match="cannot bind"):
        other.start()


def test_the_replay_buffer_keeps_the_last_messages_of_each_topic():
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", base_topic="kv", replay_batches=2)
    p.start()
    sub = KvSubscriber(p.address, p.replay_address, "kv", DECODE)
    try:
        for h in (b"1", b"2", b"3"):
            p.publish("kv", [stored(h)])
            assert p.flush(30)
        assert [seq for _, seq, _ in sub.replay(0)] == [1, 2]
    finally:
        sub.close()
        p.stop()
