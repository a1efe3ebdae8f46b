"""Clients that stop reading or writing cost a connection, not the server: `tiercache serve` as a real process, with
stalled Put streams, unread Get streams and clients over the stream limit, while a well-behaved client is served."""

from __future__ import annotations

import os
import threading
import urllib.request

import grpc
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, wait_for
from tiercache.client import Client, RetryPolicy
from tiercache.config import MiB
from tiercache.errors import CapacityExceeded
from tiercache.process import ServerProcess
from tiercache.protocol.wire import pb, pb_grpc

NS = "stalls"
STALLED = 20  # more than server.workers (16): with a thread per stream these froze the server


@pytest.fixture
def server(request, tmp_path):
    """A server whose idle timeout is the test's `idle_timeout_s` mark (default 5 s: long enough that a
    well-behaved client on a loaded machine never idles that long between frames, short enough to wait for)."""
    mark = request.node.get_closest_marker("idle_timeout_s")
    idle_s = mark.args[0] if mark else 5
    config = tmp_path / "tiercache.yaml"
    config.write_text(f"server:\n  stream_idle_timeout_s: {idle_s}\n  max_streams_per_peer: 48\n"
                      "  max_streams_per_client: 48\n"
                      "host:\n  capacity_bytes: 512MiB\ndisk:\n  capacity_bytes: 0\n")
    metrics_port = free_port()
    with ServerProcess("--config", str(config), "--metrics-port", str(metrics_port)) as process:
        process.metrics_port = metrics_port
        yield process


def in_flight(server) -> int:
    """Requests the server is serving now, from its /metrics (tiercache_requests_in_flight)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "tiercache_requests_in_flight" for sample in family.samples)


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
        wait_for(lambda: len(stalls.errors) == STALLED, timeout_s=60, what="the stalled Puts to be ended")
        assert set(stalls.errors) == {grpc.StatusCode.UNAVAILABLE}
        assert client.get(NS, b"never") is None  # nothing half-written was stored


@pytest.mark.idle_timeout_s(600)  # the stalled streams stay open until the test releases them, however slow the machine
def test_streams_over_the_per_host_limit_are_refused_at_once_and_unary_calls_still_served(server, stalls):
    stalls.put_and_stall(48)  # the limit of this host (server.max_streams_per_peer)
    wait_for(lambda: in_flight(server) == 48, timeout_s=60, what="the 48 stalled Puts to be open on the server")
    with Client.from_url(server.url, timeout_s=5, retry=RetryPolicy(attempts=1), same_host=False,
                         data_channel=False) as client:  # gRPC streams (the data channel is refused the same)
        with pytest.raises(CapacityExceeded, match="max_streams_per_peer"):
            client.put(NS, b"one-too-many", b"x")
        assert client.locate(NS, [b"one-too-many"]) == [None]  # unary calls are not streams
        stalls.release.set()  # the stalled clients end their streams short of the size they announced
        wait_for(lambda: len(stalls.errors) == 48, timeout_s=60, what="the stalled Puts to be ended")
        wait_for(lambda: in_flight(server) == 0, timeout_s=60, what="the server to count them ended")
        assert client.put(NS, b"after", b"y") == "host"  # their slots are free again
