"""Clients that stop reading or writing cost a connection, not the server: `tiercache serve` as a real process, with
stalled Put streams, unread Get streams and clients over the stream limit, while a well-behaved client is served."""

from __future__ import annotations

import os
import threading

import grpc
import pytest

from tests.helpers import wait_for
from tiercache.client import Client, RetryPolicy
from tiercache.config import MiB
from tiercache.errors import CapacityExceeded
from tiercache.process import ServerProcess
from tiercache.protocol.wire import pb, pb_grpc

NS = "stalls"
STALLED = 20  # more than server.workers (16): with a thread per stream these froze the server


@pytest.fixture
def server(tmp_path):
    config = tmp_path / "tiercache.yaml"
    config.write_text("server:\n  stream_idle_timeout_s: 2\n  max_streams_per_peer: 48\n"
                      "host:\n  capacity_bytes: 512MiB\ndisk:\n  capacity_bytes: 0\n")
    with ServerProcess("--config", str(config)) as process:
        yield process


class _Stalls:
    """Streams that misbehave, each on its own channel: Puts that send a header and then nothing, Gets that start
    and are never read. `errors` collects the status code each stalled Put ended with."""

    def __init__(self, url: str) -> None:
        self.target = url.removeprefix("grpc://")
        self.release = threading.Event()
        self.errors: list[grpc.StatusCode] = []
        self._channels: list[grpc.Channel] = []
        self._threads: list[threading.Thread] = []
        self.unread: list = []

    def _stub(self) -> pb_grpc.TierCacheStub:
        channel = grpc.insecure_channel(self.target)
        self._channels.append(channel)
        return pb_grpc.TierCacheStub(channel)

    def put_and_stall(self, count: int) -> None:
        def stalled() -> None:
            def frames():
                yield pb.PutFrame(header=pb.ChunkHeader(namespace=NS, key=b"never", size_bytes=MiB))
                self.release.wait()
            try:
                self._stub().Put(frames(), timeout=60)
            except grpc.RpcError as exc:
                self.errors.append(exc.code())
        for _ in range(count):
            thread = threading.Thread(target=stalled, daemon=True)
            thread.start()
            self._threads.append(thread)

    def get_and_never_read(self, count: int, key: bytes) -> None:
        for _ in range(count):
            stream = self._stub().Get(pb.GetRequest(namespace=NS, keys=[key] * 4), timeout=60)
            next(stream)  # the first header arrives; the 64 MiB behind it are never read
            self.unread.append(stream)

    def close(self) -> None:
        self.release.set()
        for stream in self.unread:
            stream.cancel()
        for thread in self._threads:
            thread.join(timeout=30)
        for channel in self._channels:
            channel.close()


@pytest.fixture
def stalls(server):
    stalls = _Stalls(server.url)
    yield stalls
    stalls.close()


def test_stalled_and_unread_streams_do_not_stop_the_server_serving_others(server, stalls):
    big = os.urandom(16 * MiB)
    with Client.from_url(server.url, same_host=False) as setup:
        setup.put(NS, b"big", big)
    stalls.put_and_stall(STALLED)
    stalls.get_and_never_read(STALLED, b"big")
    with Client.from_url(server.url, timeout_s=5, retry=RetryPolicy(attempts=1), same_host=False) as client:
        assert client.stats()["tiers"]
        data = os.urandom(4 * MiB)
        assert client.put(NS, b"fresh", data) == "host"  # a streamed Put
        assert client.get(NS, b"fresh") == data  # a streamed Get
        assert client.get(NS, b"big") == big
        # The idle timeout ends the stalled Puts (UNAVAILABLE, which a live but slow client retries).
        wait_for(lambda: len(stalls.errors) == STALLED, timeout_s=30, what="the stalled Puts to be ended")
        assert set(stalls.errors) == {grpc.StatusCode.UNAVAILABLE}
        assert client.get(NS, b"never") is None  # nothing half-written was stored


def test_streams_over_the_per_host_limit_are_refused_at_once_and_unary_calls_still_served(server, stalls):
    stalls.put_and_stall(48)  # the limit of this host (server.max_streams_per_peer)
    with Client.from_url(server.url, timeout_s=5, retry=RetryPolicy(attempts=1), same_host=False,
                         data_channel=False) as client:  # gRPC streams (the data channel is refused the same)
        def refused() -> bool:
            try:
                client.put(NS, b"one-too-many", b"x")
            except CapacityExceeded as exc:
                refused.error = exc
                return True
            client.delete(NS, [b"one-too-many"])  # the stalled streams were not all open yet
            return False
        wait_for(refused, timeout_s=10, what="a stream over the limit to be refused")
        assert "max_streams_per_peer" in str(refused.error)
        assert client.locate(NS, [b"one-too-many"]) == [None]  # unary calls are not streams
        wait_for(lambda: len(stalls.errors) == 48, timeout_s=30, what="the stalled Puts to be ended")
        assert client.put(NS, b"after", b"y") == "host"  # their slots are free again
