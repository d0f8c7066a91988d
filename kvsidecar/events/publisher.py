"""The ZeroMQ publisher of KV events: vLLM's wire format, one sequence and replay buffer per topic, never in the way.

Wire format, as vLLM's ZmqEventPublisher sends it: every message is the multipart (topic, seq, payload) on a PUB
socket, seq an 8-byte big-endian counter of the topic's messages from 0, payload one msgpack `KVEventBatch`. The
replay socket (ROUTER) answers a request (empty delimiter, 8-byte start seq) with every buffered (topic, seq, payload)
of the base topic from that seq on, then (b"", -1 as 8 signed bytes, b""); a fourth request frame naming a topic
replays that topic instead (our addition: sequences are per topic, so a tenant's subscriber sees no gaps).

One thread owns both sockets. `publish` only appends to a bounded queue under a lock: a save never waits for a
subscriber, an encoder or a socket. ZeroMQ's PUB socket drops a subscriber's messages past its high-water mark
itself (the subscriber sees a gap in seq and asks the replay socket); when this queue is full, the events are
dropped, counted, and the topic's next message starts with AllBlocksCleared, so no subscriber keeps a view that
silently misses a change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq
from prometheus_client import CollectorRegistry, Counter

from kvsidecar.events.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

__all__ = [
    "DEFAULT_QUEUE_WEIGHT",
    "DEFAULT_REPLAY_BATCHES",
    "END_SEQ",
    "Event",
    "Publisher",
    "PublisherError",
]

log = logging.getLogger(__name__)

Event = BlockStored | BlockRemoved | AllBlocksCleared
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# What may wait for the publisher thread, in block hashes plus token ids (an event's size in memory); past it,
# publish drops. About 40 MiB of Python objects at most; 10 ms of any real node's saves is far less.
DEFAULT_QUEUE_WEIGHT = 1 << 20
DEFAULT_REPLAY_BATCHES = 10_000  # messages kept per topic for replay (vLLM's buffer_steps default) ...
DEFAULT_REPLAY_BYTES = 64 << 20  # ... and at most this many payload bytes per topic (our messages batch 10 ms)
DEFAULT_HWM = 100_000  # messages ZeroMQ queues per subscriber before it drops for that subscriber
MAX_BATCH_EVENTS = 1024  # events in one message
BATCH_INTERVAL_S = 0.01  # the thread sends what was queued this often: events wait at most this long, in batches


class PublisherError(RuntimeError):
    """The publisher cannot bind its sockets."""


class Publisher:
    """Publishes events on `endpoint` (PUB) and replays recent messages on `replay_endpoint` (ROUTER)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        base_topic: str = "",
        registry: CollectorRegistry | None = None,
        queue_weight: int = DEFAULT_QUEUE_WEIGHT,
        replay_batches: int = DEFAULT_REPLAY_BATCHES,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        """base_topic: the topic a replay request without a topic frame replays (vLLM's subscribers send none)."""
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._base_topic = base_topic
        self._queue_weight = queue_weight
        self._replay_batches = replay_batches
        self._hwm = hwm
        self._lock = threading.Condition(threading.Lock())
        self._queue: deque[tuple[str, Sequence[Event]]] = deque()
        self._queued = 0  # the queue's weight
        self._lost: set[str] = set()  # topics whose events were dropped since their last message
        self._sending = False  # the thread holds events taken off the queue and not yet sent
        self._stopping = False
        self._seq: dict[str, int] = {}
        self._replay: dict[str, deque[tuple[int, bytes]]] = {}
        self._replay_bytes: dict[str, int] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.address = ""
        self.replay_address = ""
        r = registry if registry is not None else CollectorRegistry()
        self.messages = Counter("kvsidecar_kv_events_messages", "KV-event messages (batches) published.", registry=r)
        self.events = Counter("kvsidecar_kv_events_events", "KV events published.", registry=r)
        self.dropped = Counter(
            "kvsidecar_kv_events_dropped_events",
            "KV events dropped because the publisher's queue was full (the topic's next message clears all).",
            registry=r,
        )
        self.replays = Counter("kvsidecar_kv_events_replays", "Replay requests answered.", registry=r)

    def start(self) -> None:
        """Bind both sockets and start the thread; PublisherError if an address cannot be bound."""
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.address = _bind(self._pub, self._endpoint)
            if self._replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # Room for one whole replay; past it a client that stopped reading loses the rest, never blocks us.
                self._router.setsockopt(zmq.SNDHWM, 2 * (self._replay_batches + 1))
                self.replay_address = _bind(self._router, self._replay_endpoint)
        except PublisherError:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv events on %s (replay %s)", self.address, self.replay_address or "off")

    def publish(self, topic: str, events: Sequence[Event]) -> None:
        """Queue events for `topic`, in order; never blocks: past the queue's bound they are dropped and counted."""
        if not events:
            return
        weight = sum(map(_weight, events))
        with self._lock:
            if self._stopping:
                return
            if self._queued + weight > self._queue_weight:
                self._lost.add(topic)
                self.dropped.inc(len(events))
                return
            self._queue.append((topic, events))
            self._queued += weight
            # No notify: the thread wakes every BATCH_INTERVAL_S by itself. Waking it at every save cost saves
            # more than the events themselves (a GIL hand-off each time), and batches only got smaller.

    def flush(self, timeout: float) -> bool:
        """Wait until every queued event was sent (tests, shutdown); False if the timeout passed first."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._queued or self._sending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, BATCH_INTERVAL_S))
        return True

    def stop(self) -> None:
        """Send what is queued (briefly), stop the thread and close the sockets."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._stopping:
                    self._lock.wait(BATCH_INTERVAL_S)
                taken = list(self._queue)
                self._queue.clear()
                self._queued = 0
                lost, self._lost = self._lost, set()
                stopping = self._stopping
                self._sending = bool(taken)
            try:
                self._send(taken, lost)
                self._serve_replays()
            except zmq.ZMQError as exc:  # a socket error loses these messages, never the thread
                log.error("kv events: %s", exc)
            finally:
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()
            if stopping:
                return

    def _send(self, taken: list[tuple[str, Sequence[Event]]], lost: set[str]) -> None:
        by_topic: dict[str, list[Event]] = {topic: [AllBlocksCleared()] for topic in lost}
        for topic, events in taken:
            by_topic.setdefault(topic, []).extend(events)
        assert self._pub is not None
        for topic, events in by_topic.items():
            for start in range(0, len(events), MAX_BATCH_EVENTS):
                part = events[start : start + MAX_BATCH_EVENTS]
                payload = encode_batch(KVEventBatch(ts=time.time(), events=part))
                seq = self._seq.get(topic, 0)
                self._seq[topic] = seq + 1
                # NOBLOCK: a PUB socket never blocks anyway; past a subscriber's HWM ZeroMQ drops for it alone.
                self._pub.send_multipart((topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                self._keep(topic, seq, payload)
                self.messages.inc()
                self.events.inc(len(part))

    def _keep(self, topic: str, seq: int, payload: bytes) -> None:
        """Keep a message for replay: the topic's last replay_batches messages, within DEFAULT_REPLAY_BYTES."""
        buffer = self._replay.setdefault(topic, deque())
        buffer.append((seq, payload))
        size = self._replay_bytes.get(topic, 0) + len(payload)
        while len(buffer) > self._replay_batches or (size > DEFAULT_REPLAY_BYTES and len(buffer) > 1):
            size -= len(buffer.popleft()[1])
        self._replay_bytes[topic] = size

    def _serve_replays(self) -> None:
        router = self._router
        if router is None:
            return
        while router.poll(0):
            frames = router.recv_multipart()
            if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kv events: ignoring a malformed replay request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            topic = frames[3].decode(errors="replace") if len(frames) == 4 else self._base_topic
            self.replays.inc()  # before the answer: whoever got the answer sees the count
            try:
                for seq, payload in self._replay.get(topic, ()):
                    if seq >= start:
                        router.send_multipart(
                            (client, b"", topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                        )
                router.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("kv events: a replay client stopped reading; its replay was cut short")


def _weight(event: Event) -> int:
    """An event's share of the queue's bound: its block hashes and token ids."""
    if isinstance(event, BlockStored):
        return 1 + len(event.block_hashes) + len(event.token_ids)
    if isinstance(event, BlockRemoved):
        return 1 + len(event.block_hashes)
    return 1


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind and return the bound address (a tcp port 0 becomes the port the kernel picked)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise PublisherError(f"cannot bind KV-event socket {endpoint}: {exc}") from None
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)
