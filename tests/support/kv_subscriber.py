"""A router's subscriber to KV events: live messages on a SUB socket, gaps filled from the replay socket.

It imports only pyzmq, so both the main suite (decoding with kvsidecar's own messages) and the vLLM suite (decoding
with vLLM's `kv_events` classes) use it. A ZeroMQ subscription takes effect a moment after connecting, so what was
published before it is asked of the replay socket, as a real router does after a gap in the sequence numbers.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 200


class KvSubscriber:
    """Every message of one topic, in sequence order, each decoded by `decode`."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, decode: Callable[[bytes], Any]) -> None:
        self.topic = topic
        self._decode = decode
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self.expected = 0  # the next sequence number this subscriber has not seen
        self.live = 0  # messages that came on the SUB socket (the rest came from replays)
        # A subscriber a failed test forgot is closed when it is collected, sockets first: left to the garbage
        # collector, zmq's Context.__del__ may run first and wait forever for the open sockets (pytest hung at exit)
        self._closer = weakref.finalize(self, _close, self._ctx, self._sub, self._replay)

    def collect(self, done: Callable[[list[Any]], bool], timeout: float = 60.0) -> list[Any]:
        """Decoded batches from the next unseen one on, until done(batches) says so (AssertionError past timeout)."""
        batches: list[Any] = []
        end = time.monotonic() + timeout
        while not done(batches):
            if time.monotonic() > end:
                raise AssertionError(f"topic {self.topic!r}: gave up after {len(batches)} batches: {batches!r}")
            if self._sub.poll(POLL_MS):
                topic, seq_bytes, payload = self._sub.recv_multipart()
                if topic != self.topic.encode():  # SUB matches prefixes: "t.a" also receives "t.ab"
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq < self.expected:
                    continue  # already had it from a replay
                if seq > self.expected:
                    batches.extend(self._fill(seq))
                batches.append(self._decode(payload))
                self.expected = seq + 1
                self.live += 1
            else:
                batches.extend(self._fill(None))
        return batches

    def replay(self, start: int, topic: str | None = None) -> list[tuple[bytes, int, bytes]]:
        """(topic, seq, payload) the replay socket holds from start on (of `topic`, or the publisher's base topic)."""
        request = [b"", start.to_bytes(8, "big")]
        if topic is not None:
            request.append(topic.encode())
        self._replay.send_multipart(request)
        out = []
        while True:
            if not self._replay.poll(30_000):
                raise AssertionError("the replay socket did not answer")
            _, topic_bytes, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return out
            out.append((topic_bytes, int.from_bytes(seq_bytes, "big"), payload))

    def _fill(self, until: int | None) -> list[Any]:
        got = []
        for _, seq, payload in self.replay(self.expected, self.topic):
            if seq >= self.expected and (until is None or seq < until):
                got.append(self._decode(payload))
                self.expected = seq + 1
        return got

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> KvSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(ctx: zmq.Context, *sockets: zmq.Socket) -> None:
    for socket in sockets:
        socket.close(linger=0)
    ctx.term()


def stored_hashes(batches: list[Any]) -> list[bytes]:
    """Every block hash the batches' BlockStored events name, in order."""
    return [h for b in batches for e in b.events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
