"""A router's end of pods' KV-event streams on real ZMQ sockets, feeding an LlmdIndex under llm-d's subscriber rules
(testkit/llmd_index.py Source), or a CheckpointIndex (testkit/checkpoint_index.py: llm-d's index and the checkpoints'
own events): per pod a Subscriber (testkit/event_subscriber.py) on llm-d's topics, a replay from 0 on connect, gaps
repaired, a publisher that went back to seq 0 rebuilt.

Single-threaded on purpose: `pump` reads what has arrived and applies it, so a benchmark or a test decides when the
index moves (no lock between the index and whoever scores with it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import zmq

from testkit.event_subscriber import MalformedReplay, Subscriber, raw
from testkit.llmd_index import LlmdIndex, Source, parse_topic

if TYPE_CHECKING:
    from testkit.checkpoint_index import CheckpointIndex

LLMD_TOPICS = b"kv@"  # llm-d's topic filter


class PodFeed:
    """One pod's stream: `endpoint` (PUB), `replay_endpoint` (ROUTER), `pod` the name the index files it under (the
    topic's, unless llm-d's pod discovery names it: its SourceEndpoint)."""

    def __init__(self, index: LlmdIndex | CheckpointIndex, context: zmq.Context, endpoint: str, replay_endpoint: str,
                 replay_timeout_s: float = 10.0) -> None:
        self.index = index
        self.subscriber = Subscriber(endpoint, replay_endpoint, decode=raw, topic=LLMD_TOPICS, context=context)
        self.replay_timeout_s = replay_timeout_s
        self.pod: str | None = None
        self.source = Source(self._deliver, self._replay, self._reset)
        self.batches = 0  # batches applied (live and replayed)

    @property
    def sub(self) -> zmq.Socket:
        """The live stream's socket (Feeds polls every pod's at once)."""
        return self.subscriber.sub

    def connect(self) -> "PodFeed":
        self.source.connect()
        return self

    def pump(self, timeout_s: float = 0.0) -> int:
        """Apply the live batches that arrive within `timeout_s` (all that are waiting, at least); how many came."""
        came = 0
        while self.subscriber.waiting(timeout_s if came == 0 else 0):
            topic, seq, payload = self.subscriber.next(0)
            self.source.live(seq, (topic, payload))
            came += 1
        return came

    def _deliver(self, seq: int, message: tuple[bytes, bytes]) -> None:
        topic, payload = message
        self.pod = parse_topic(topic)[0]
        self.index.apply(topic, payload)
        self.batches += 1

    def _reset(self) -> None:
        if self.pod is not None:
            self.index.clear_pod(self.pod)

    def _replay(self, start: int) -> list | None:
        try:
            frames = self.subscriber.replay(start, self.replay_timeout_s)
        except (TimeoutError, MalformedReplay):
            return None  # llm-d gives an attempt 2 s idle and the whole replay 2 min; one attempt here
        return [(seq, (topic, payload)) for topic, seq, payload in frames]

    def close(self) -> None:
        self.subscriber.close()


class Feeds:
    """Several pods' feeds into one index, pumped together."""

    def __init__(self, index: LlmdIndex | CheckpointIndex | None = None) -> None:
        self.index = index if index is not None else LlmdIndex()
        self.context = zmq.Context()
        self.feeds: dict[str, PodFeed] = {}

    def add(self, name: str, endpoint: str, replay_endpoint: str) -> PodFeed:
        feed = self.feeds[name] = PodFeed(self.index, self.context, endpoint, replay_endpoint)
        return feed.connect()

    def pump(self, timeout_s: float = 0.0) -> int:
        poller = zmq.Poller()
        for feed in self.feeds.values():
            poller.register(feed.sub, zmq.POLLIN)
        poller.poll(int(timeout_s * 1000))
        return sum(feed.pump() for feed in self.feeds.values())

    def until(self, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Pump until `condition()` holds (TimeoutError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the index did not catch up within {timeout_s} s")
            self.pump(0.05)

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.context.term()
