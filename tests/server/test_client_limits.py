"""One stuck engine does not lock out the other engines of its node (server.limits). Engines on one node share one
host address; each client names itself on every request (protocol.client_id), so the server counts a client's
requests in flight apart from its neighbours'. A real in-process server; raw gRPC channels and raw data-channel
sockets play the stuck engine, real Clients the neighbours."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from tests.helpers import wait_for
from tiercache.client import Client, RetryPolicy
from tiercache.config import MiB
from tiercache.errors import CapacityExceeded, InvalidArgument
from tiercache.protocol import client_id, data_channel
from tiercache.protocol.data_channel import PutEntry
from tiercache.protocol.wire import pb, pb_grpc
from tiercache.record.encoding import ChunkMeta

NS = "model@main#fp"
PER_CLIENT = 4


class StuckEngine:
    """A client named `name` whose Put streams and data-channel puts stop half-way and stay open until released."""

    def __init__(self, server, name: str) -> None:
        self.server, self.name = server, name
        self.release = threading.Event()
        self.channel = grpc.insecure_channel(server.url.removeprefix("grpc://"))
        self.calls: list = []
        self.sockets: list[socket.socket] = []

    def stall_streams(self, n: int) -> None:
        def frames():
            yield pb.PutFrame(header=pb.ChunkHeader(namespace=NS, key=b"never", size_bytes=MiB))
            self.release.wait(60)
        stub = pb_grpc.TierCacheStub(self.channel)
        for _ in range(n):
            self.calls.append(stub.Put.future(frames(), timeout=90,
                                                metadata=((client_id.METADATA_KEY, self.name),)))

    def stall_data_puts(self, n: int) -> None:
        for _ in range(n):
            sock = self.data_connection()
            sock.sendall(data_channel.put_request(NS, [PutEntry(b"half", MiB, ChunkMeta())]) + bytes(1000))
            self.sockets.append(sock)

    def data_connection(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.server.data_port), timeout=30)
        sock.sendall(data_channel.hello("", self.name))
        data_channel.read_status(sock)
        return sock

    def close(self) -> None:
        self.release.set()
        for sock in self.sockets:
            sock.close()
        for call in self.calls:
            call.cancel()
        self.channel.close()


@pytest.fixture
def server(start_server):
    return start_server(max_streams_per_client=PER_CLIENT, max_streams_per_peer=64, stream_idle_timeout_s=60)


def held(server) -> int:
    """Requests in flight from this host (the stuck engine's, while no neighbour has one open)."""
    return server.intake.limits.peers.held("127.0.0.1")


def neighbour(server, **options) -> Client:
    return Client.from_url(server.url, timeout_s=10, retry=RetryPolicy(attempts=1), same_host=False, **options)


def test_a_stuck_engine_at_its_limit_leaves_the_other_engines_of_its_host_served(server):
    stuck = StuckEngine(server, "stuck-engine")
    try:
        stuck.stall_streams(PER_CLIENT // 2)
        stuck.stall_data_puts(PER_CLIENT // 2)  # both transports count against the one client
        wait_for(lambda: held(server) == PER_CLIENT, what="the stuck engine's requests in flight")
        # Its next request, on either transport, is refused at once, naming its limit.
        late = stuck.data_connection()
        late.sendall(data_channel.get_request(NS, [b"k"]))
        with pytest.raises(CapacityExceeded, match="client 'stuck-engine' of 127.0.0.1 has 4 requests in flight "
                                                   r"\(server.max_streams_per_client\)"):
            data_channel.read_status(late)
        late.close()
        stuck.stall_streams(1)
        with pytest.raises(grpc.RpcError) as refused:
            stuck.calls[-1].result(timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_client" in refused.value.details()
        # The engines beside it, on the same address, are served on both transports.
        with neighbour(server) as remote, neighbour(server, data_channel=False) as streamed:
            for n, client in enumerate((remote, streamed)):
                data = bytes([n]) * 300_000
                client.put(NS, b"neighbour-%d" % n, data)
                assert client.get(NS, b"neighbour-%d" % n) == data
        assert held(server) == PER_CLIENT
    finally:
        stuck.close()
    wait_for(lambda: server.intake.limits.peers.snapshot() == {}, timeout_s=30, what="the stalled requests to end")


def test_a_client_id_that_is_not_a_short_printable_name_is_refused_in_one_line(server):
    channel = grpc.insecure_channel(server.url.removeprefix("grpc://"))
    try:
        call = pb_grpc.TierCacheStub(channel).Get(pb.GetRequest(namespace=NS, keys=[b"k"]),
                                                    metadata=((client_id.METADATA_KEY, "x" * 65),), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "tiercache-client: a client id is at most 64 printable ASCII characters"
    finally:
        channel.close()
    with pytest.raises(InvalidArgument, match="at most 64 printable"):
        data_channel.hello("", "bad\nname")
