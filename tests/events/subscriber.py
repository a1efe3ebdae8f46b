"""A router's end of a pod's event streams, on real ZMQ sockets: a SUB for live batches and a DEALER for replays, with
payloads decoded by a `decode` function (msgpack here; vLLM's own classes in tests/vllm/test_events.py)."""

from __future__ import annotations

import time
from typing import Callable

import msgpack
import zmq


def plain(payload: bytes):
    """A batch as plain data: [ts, [event maps], dp_rank]."""
    return msgpack.unpackb(payload)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str, decode: Callable[[bytes], object] = plain) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decode = decode

    def ready(self, timeout_s: float = 10.0) -> "Subscriber":
        """Wait for a live batch (a heartbeat comes every second): a SUB socket gets only what is sent after its
        subscription reached the publisher, which connect() does not wait for (ZMQ's slow joiner)."""
        self.next(timeout_s)
        return self

    def next(self, timeout_s: float = 10.0) -> tuple[bytes, int, object]:
        """The next live batch: (topic, seq, decoded payload)."""
        if not self.sub.poll(int(timeout_s * 1000)):
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
        """Ask for a replay from `start`: [(topic, seq, batch)] up to the end marker."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            frames = []
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError("the replay did not end")
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert topic == b"" and payload == b""
                    return frames
                frames.append((topic, int.from_bytes(seq, "big"), self.decode(payload)))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()
        self.context.term()
