"""A router's end of one pod's KV-event streams, on real ZMQ sockets: a SUB for live batches and a DEALER for replays.

The tests read the publisher's streams through it (tests/events, tests/vllm, tests/dynamo: every topic, payloads
decoded by `decode`, msgpack by default or vLLM's own classes) and so does the llm-d-rules router's feed
(testkit/llmd_subscriber.py: llm-d's topic filter, raw payloads handed to an index, the sockets of several pods on
one ZMQ context). A replay that is malformed or does not end in time raises; the llm-d feed takes either as a failed
replay, as llm-d does.
"""

from __future__ import annotations

import time
from typing import Callable

import msgpack
import zmq

END_SEQ = -1  # the seq of the frame that ends a replay


class MalformedReplay(ValueError):
    """A replay frame that is not [empty, topic, seq, payload], or an end marker with a topic or a payload."""


def plain(payload: bytes):
    """A batch as plain data: [ts, [event maps], dp_rank]."""
    return msgpack.unpackb(payload)


def raw(payload: bytes) -> bytes:
    """A batch as the publisher sent it (for an index that decodes it itself)."""
    return payload


class Subscriber:
    """`topic`: the prefix of the topics subscribed to (b"": all); `context`: a ZMQ context shared with other
    subscribers, which `close` leaves to its owner (None: one of its own, terminated by `close`)."""

    def __init__(self, endpoint: str, replay_endpoint: str, decode: Callable[[bytes], object] = plain,
                 topic: bytes = b"", context: zmq.Context | None = None) -> None:
        self._own_context = context is None
        self.context = zmq.Context() if context is None else context
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decode = decode

    def ready(self, timeout_s: float = 10.0) -> "Subscriber":
        """Wait for a live batch (a heartbeat comes every second): a SUB socket gets only what is sent after its
        subscription reached the publisher, which connect() does not wait for (ZMQ's slow joiner)."""
        self.next(timeout_s)
        return self

    def waiting(self, timeout_s: float = 0.0) -> bool:
        """Whether a live batch has arrived, waiting up to `timeout_s` for one."""
        return bool(self.sub.poll(int(timeout_s * 1000)))

    def next(self, timeout_s: float = 10.0) -> tuple[bytes, int, object]:
        """The next live batch: (topic, seq, decoded payload)."""
        if not self.waiting(timeout_s):
            raise TimeoutError(f"no batch within {timeout_s} s")
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), self.decode(payload)

    def until(self, condition: Callable[[object], bool], timeout_s: float = 10.0) -> list[tuple[int, object]]:
        """Live batches until one satisfies `condition` (that one included): [(seq, batch)]."""
        deadline = time.monotonic() + timeout_s
        seen = []
        while True:
            _, seq, batch = self.next(max(0.01, deadline - time.monotonic()))
            seen.append((seq, batch))
            if condition(batch):
                return seen

    def replay(self, start: int, timeout_s: float = 10.0) -> list[tuple[bytes, int, object]]:
        """Ask for a replay from `start`: [(topic, seq, batch)] up to the end marker. TimeoutError when no frame
        comes for `timeout_s`; MalformedReplay on a frame of another shape."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            frames = []
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError("the replay did not end")
                parts = dealer.recv_multipart()
                if len(parts) != 4 or parts[0] != b"":
                    raise MalformedReplay(f"a replay frame of {len(parts)} parts: {parts[:1]}")
                _, topic, seq, payload = parts
                if int.from_bytes(seq, "big", signed=True) == END_SEQ:
                    if topic or payload:
                        raise MalformedReplay(f"an end marker with topic {topic!r} and {len(payload)} bytes")
                    return frames
                frames.append((topic, int.from_bytes(seq, "big"), self.decode(payload)))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()
        if self._own_context:
            self.context.term()
