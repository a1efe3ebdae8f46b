"""The data channel (tiercache.protocol.data_channel): remote payloads over a plain socket beside gRPC. Real servers,
real sockets, real certificates; raw sockets play the clients that misbehave."""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time

import grpc
import pytest

from tests.certs import make_pki
from tests.helpers import wait_for
from tests.server.test_security import NS_A, NS_B, TOKEN_A, tenants_file  # noqa: F401 - a fixture, used by name
from tiercache.client import Backoff, Chunk, Client, RetryPolicy, chooser
from tiercache.client.data_channel import DEFAULT_STREAMS, STRIPE_MIN_BYTES, DataChannelPath, _stripes
from tiercache.config import EventsConfig, MiB, SecurityConfig
from tiercache.errors import Busy, CapacityExceeded, ConnectionBroken, PermissionDenied, TierCacheError, Unauthenticated
from tiercache.process import ServerProcess, free_port
from tiercache.protocol import data_channel, sockets
from tiercache.protocol.data_channel import PutEntry
from tiercache.protocol.wire import pb, pb_grpc
from tiercache.record.encoding import CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey
import tiercache.server.data_channel
from tiercache.server.intake import SERVE_BATCH

NS = "model@main#fp"


def _client(server, **options) -> Client:
    options = {"timeout_s": 10, "retry": RetryPolicy(attempts=1), "same_host": False, **options}
    return Client.from_url(server.url, **options)


def _served(server, method: str, code: str = "OK") -> float:
    value = server.metrics.registry.get_sample_value("tiercache_rpc_duration_seconds_count",
                                                     {"method": method, "code": code})
    return value or 0.0


def _wait_served(server, expected: dict[tuple[str, str], int]) -> None:
    """The server counts a request just after answering it: wait for the counts (a miss fails after 10 s)."""
    def counted() -> bool:
        return all(_served(server, method, code) == n for (method, code), n in expected.items())
    wait_for(counted, timeout_s=10, what=f"requests counted as {expected}")


def _requests_for(sizes: list[int]) -> int:
    """How many requests (stripes) a batch of chunks of these sizes becomes; gets count every key as a full stripe."""
    return len(_stripes(sizes, DEFAULT_STREAMS))


def _gets_for(keys: int) -> int:
    return _requests_for([STRIPE_MIN_BYTES] * keys)


def _raw(server, token: str | None = None) -> socket.socket:
    """A bare connection to the data port, past its hello when `token` is not None (open servers: token '')."""
    return _connect(server.data_port, token)


def _connect(port: int, token: str | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if token is not None:
        sock.sendall(data_channel.hello(token))
        data_channel.read_status(sock)
    return sock


def _closed_by_server(sock: socket.socket, timeout_s: float = 10) -> bool:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


# -- the path -----------------------------------------------------------------------------------------------------

def test_puts_and_gets_go_over_the_data_channel_byte_exact(start_server):
    server = start_server()
    payloads = {b"empty": b"", b"small": b"tiny", b"odd": bytes(range(256)) * 4099, b"big": bytes(5 * MiB + 3)}
    with _client(server) as client:
        stored = client.put_many(NS, [(k, v) for k, v in payloads.items()])
        assert stored == ["host"] * len(payloads)
        got = client.get_many(NS, [*payloads, b"missing"])
        assert [bytes(g.data) if g is not None else None for g in got] == [*payloads.values(), None]
        buffers = [bytearray(len(v) + 10) for v in payloads.values()]
        assert [f.tier for f in client.get_many(NS, list(payloads), buffers)] == ["host"] * len(payloads)
        assert all(bytes(b[:len(v)]) == v for b, v in zip(buffers, payloads.values()))
        with pytest.raises(TierCacheError, match="cannot hold"):
            client.get_many(NS, [b"big", b"small"], [bytearray(10), bytearray(10)])
        assert client.get(NS, b"small") == b"tiny"  # the connection is still in step after the drained chunk
        reused = bytearray(len(payloads[b"odd"]) + 5)
        view = client.get(NS, b"odd", into=reused)
        assert isinstance(view, memoryview) and view.obj is reused and view == payloads[b"odd"]
    gets = _gets_for(5) + _gets_for(4) + _gets_for(2) + 2
    puts = _requests_for([len(v) for v in payloads.values()])
    _wait_served(server, {("DataPut", "OK"): puts, ("DataGet", "OK"): gets, ("Put", "OK"): 0, ("Get", "OK"): 0})


def test_a_large_batch_is_striped_over_parallel_connections_in_order(start_server):
    server = start_server(host_bytes=256 * MiB)
    payloads = [bytes([i]) * (3 * MiB + i) for i in range(8)]
    keys = [b"s%d" % i for i in range(8)]
    with _client(server) as client:
        assert client.put_many(NS, list(zip(keys, payloads))) == ["host"] * 8
        got = client.get_many(NS, [*keys, b"none"])
        assert [bytes(g.data) for g in got[:8]] == payloads and got[8] is None
    puts, gets = _requests_for([len(p) for p in payloads]), _gets_for(9)
    assert puts > 1 and gets > 1  # several stripes, in parallel
    _wait_served(server, {("DataPut", "OK"): puts, ("DataGet", "OK"): gets})


def test_metadata_travels_with_the_chunk(start_server):
    server = start_server()
    with _client(server) as client:
        client.put_many(NS, [Chunk(b"kv", b"k" * 100), Chunk(b"state", b"s" * 50, ChunkMeta(CLASS_STATE, 16, b"kv"))])
    children = server.store.children(ChunkKey(NS, b"kv"))
    assert [(key.key, meta) for key, meta in children] == [(b"state", ChunkMeta(CLASS_STATE, 16, b"kv"))]


@pytest.mark.parametrize("path", ["data channel", "grpc streams", "same host"])
def test_tokens_and_engine_hashes_travel_with_the_chunk_on_every_path(start_server, path):
    """The optional engine block (token ids, the engine's block hash: what the KV events name a block by,
    docs/events.md) reaches the store of a server that publishes KV events by each path, and a chunk without one
    beside it stays without one."""
    server = start_server(events=EventsConfig(enabled=True))
    options = {"data channel": {}, "grpc streams": {"data_channel": False},
               "same host": {"same_host": True}}[path]
    engine = ChunkMeta(0, 544, b"parent", tokens=bytes(range(256)) * 8, engine_hash=2**64 - 1)
    with _client(server, **options) as client:
        client.put_many(NS, [Chunk(b"kv", b"k" * 100, engine), Chunk(b"tail", b"t" * 10, ChunkMeta(0, 3, b"parent"))])
        assert client.same_host == (path == "same host")
    children = sorted(server.store.children(ChunkKey(NS, b"parent")))
    assert [(key.key, meta) for key, meta in children] == [(b"kv", engine), (b"tail", ChunkMeta(0, 3, b"parent"))]


@pytest.mark.parametrize("path", ["data channel", "grpc streams", "same host"])
def test_a_server_without_kv_events_keeps_no_engine_blocks(start_server, path):
    """Tokens cost 4 bytes per token in every tier's index and record: a server that publishes no KV events says so
    in Attach (the data channel then leaves them out) and drops them from what other paths bring."""
    server = start_server()
    options = {"data channel": {}, "grpc streams": {"data_channel": False},
               "same host": {"same_host": True}}[path]
    with _client(server, **options) as client:
        client.put_many(NS, [Chunk(b"kv", b"k" * 100, ChunkMeta(0, 544, b"parent", tokens=bytes(64), engine_hash=9))])
        assert client.same_host == (path == "same host")
    assert server.store.children(ChunkKey(NS, b"parent")) == [(ChunkKey(NS, b"kv"), ChunkMeta(0, 544, b"parent"))]


def test_a_server_that_does_not_take_engine_blocks_gets_puts_without_them(start_server):
    """A server older than the engine block (its Attach does not say engine_blocks) would refuse a data-channel put
    that carries one: the client leaves tokens and hash out for such a server, and keeps the rest of the meta."""
    server = start_server()
    path = DataChannelPath(("127.0.0.1", server.data_port), token=None, engine_blocks=False)
    try:
        meta = ChunkMeta(0, 4, b"parent", tokens=bytes(16), engine_hash=7)
        path.put(NS, [Chunk(b"kv", b"k" * 10, meta)], time.monotonic() + 10)
    finally:
        path.close()
    assert server.store.children(ChunkKey(NS, b"parent")) == [(ChunkKey(NS, b"kv"), ChunkMeta(0, 4, b"parent"))]


def test_chunks_the_arena_cannot_take_are_received_into_a_record_of_their_own(start_server):
    server = start_server(host_bytes=2 * MiB)
    payload = bytes(range(256)) * (12 * 4096)  # 12 MiB: larger than the host arena, so it lands on disk
    with _client(server) as client:
        assert client.put(NS, b"large", payload) == "disk"
        assert client.get(NS, b"large") == payload


def test_without_an_arena_the_data_channel_still_serves(start_server):
    server = start_server(shared_memory=False)
    with _client(server) as client:
        client.put(NS, b"k", b"no arena")
        assert client.get(NS, b"k") == b"no arena"
    _wait_served(server, {("DataPut", "OK"): 1})


def test_unix_socket_clients_use_the_unix_data_channel(start_server, tmp_path):
    path = str(tmp_path / "tc.sock")
    server = start_server(unix_socket=path)
    with Client.from_url(f"grpc+unix://{path}", same_host=False) as client:
        client.put(NS, b"k", b"over unix")
        assert client.get(NS, b"k") == b"over unix"
        assert client.paths.data_channel.address == path + ".data"
    _wait_served(server, {("DataGet", "OK"): 1})


def test_no_data_channel_when_the_server_has_none(start_server):
    server = start_server(data_channel=False)
    assert server.data_port == 0
    with _client(server) as client:
        client.put(NS, b"k", b"streamed")
        assert client.get(NS, b"k") == b"streamed"
    _wait_served(server, {("Put", "OK"): 1})


# -- the same checks as gRPC --------------------------------------------------------------------------------------

def test_a_connection_without_a_known_token_is_refused(start_server, tenants_file):  # noqa: F811
    server = start_server(security=SecurityConfig(tenants_file=tenants_file))
    for token in ("", "not-a-token-of-anyone"):
        sock = _raw(server)
        sock.sendall(data_channel.hello(token))
        with pytest.raises(Unauthenticated):
            data_channel.read_status(sock)
        assert _closed_by_server(sock)
    with _client(server, token=TOKEN_A) as a:
        a.put(NS_A, b"k", b"a's")
        assert a.get(NS_A, b"k") == b"a's"


def test_a_refused_request_is_answered_and_the_connection_serves_the_next(start_server, tenants_file):  # noqa: F811
    server = start_server(security=SecurityConfig(tenants_file=tenants_file))
    with _client(server, token=TOKEN_A) as a:
        a.put(NS_A, b"k0", bytes(300_000))
        connection = a.paths.data_channel.pooled()[0]
        for refused in (lambda: a.put(NS_B, b"k", bytes(200_000)), lambda: a.get(NS_B, b"k")):
            with pytest.raises(PermissionDenied):
                refused()
        with pytest.raises(PermissionDenied):  # both stripes of a large batch are refused, and drained
            a.put_many(NS_B, [(b"s%d" % i, bytes(3 * MiB)) for i in range(4)])
        # The stripes run on a thread pool: one refused quickly hands its connection back before the next stripe
        # takes one, so the batch used anywhere from one connection to one per stripe. Each must still be in step.
        pooled = set(a.paths.data_channel.pooled())
        assert connection in pooled and 1 <= len(pooled) <= _requests_for([3 * MiB] * 4)
        assert all(_answers_a_get(sock, NS_A, b"k0", bytes(300_000)) for sock in pooled)
        a.put_many(NS_A, [(b"k1", bytes(300_000)), (b"k2", bytes(300_000))])
        with pytest.raises(CapacityExceeded, match="quota"):  # team a's quota is 1 MiB
            a.put(NS_A, b"k3", bytes(300_000))
        assert a.get(NS_A, b"k2") == bytes(300_000) and a.get(NS_A, b"k3") is None
        assert set(a.paths.data_channel.pooled()) == pooled  # every answer kept them in step
    _wait_served(server, {("DataPut", "PERMISSION_DENIED"): 1 + _requests_for([3 * MiB] * 4),
                          ("DataGet", "PERMISSION_DENIED"): 1})


def _answers_a_get(sock: socket.socket, namespace: str, key: bytes, expected: bytes) -> bool:
    """Whether a pooled connection is in step: a get sent on it is answered with the chunk's bytes."""
    sockets.send_all(sock, data_channel.get_request(namespace, [key]))
    data_channel.read_status(sock)
    found, size, _ = data_channel.read_item(sock, len(expected))
    return found and bytes(sockets.recv_exactly(sock, size)) == expected


def test_tls_data_channel_with_the_grpc_ports_certificate_and_client_ca(start_server, tmp_path):
    pki = make_pki(tmp_path)
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  tls_client_ca_file=pki.ca))
    with _client(server, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key) as client:
        client.put(NS, b"k", b"over tls")
        assert client.get(NS, b"k") == b"over tls"
    _wait_served(server, {("DataPut", "OK"): 1})
    # No side door: plaintext gets no answer but a closed connection, a client without a certificate no handshake.
    sock = _raw(server)
    sock.sendall(data_channel.hello("") + data_channel.get_request(NS, [b"k"]))
    assert _closed_by_server(sock)
    context = ssl.create_default_context(cafile=pki.ca)
    with pytest.raises((ssl.SSLError, OSError, ConnectionBroken)):
        anonymous = context.wrap_socket(_raw(server), server_hostname="localhost")
        anonymous.sendall(data_channel.hello(""))
        data_channel.read_status(anonymous)
    assert _served(server, "DataGet") == 1  # the client's own


# -- misbehaving clients --------------------------------------------------------------------------------------------

def test_stalled_connections_cost_their_own_and_are_ended(start_server):
    server = start_server(stream_idle_timeout_s=1.0, max_streams_per_peer=64)
    stalled = []
    for i in range(20):  # half stall in their hello, half after announcing a put's chunk
        sock = _raw(server, token=None if i % 2 else "")
        if not i % 2:
            entry = data_channel.PutEntry(b"half-%d" % i, 4 * MiB, ChunkMeta())
            sock.sendall(data_channel.put_request(NS, [entry]) + bytes(1000))
        stalled.append(sock)
    with _client(server, timeout_s=5) as client:
        started = time.monotonic()
        client.put(NS, b"fresh", bytes(MiB))
        assert client.get(NS, b"fresh") == bytes(MiB)
        assert time.monotonic() - started < 5  # served while they stall (a bound far above the ~ms it takes)
        assert all(_closed_by_server(sock) for sock in stalled)
        assert client.get_many(NS, [b"half-%d" % i for i in range(0, 20, 2)]) == [None] * 10
    host = server.store.stats().tiers[0]
    assert host.chunks == 1  # the reservations of the half-sent chunks were given back


def test_a_reader_that_never_reads_is_ended_and_its_pin_released(start_server):
    server = start_server(stream_idle_timeout_s=1.0)
    with _client(server) as client:
        client.put_many(NS, [(b"big-%d" % i, bytes(8 * MiB)) for i in range(4)])
        sock = _raw(server, token="")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(data_channel.get_request(NS, [b"big-%d" % i for i in range(4)]))
        wait_for(lambda: _held(server) == 1, what="the unread get in flight")
        assert client.get(NS, b"big-0") == bytes(8 * MiB)  # others are served meanwhile
        wait_for(lambda: _served(server, "DataGet", "CANCELLED") == 1, timeout_s=10, what="the unread Get to end")
        client.delete(NS, [b"big-0"])  # nothing stays pinned
        assert client.locate(NS, [b"big-0"]) == [None]
        sock.close()


def test_connections_over_the_per_host_limit_are_refused_and_the_call_goes_over_grpc(start_server):
    server = start_server(max_data_connections_per_peer=3)
    held = [_raw(server, token="") for _ in range(3)]
    extra = _raw(server)
    extra.sendall(data_channel.hello(""))
    with pytest.raises(Busy, match="max_data_connections_per_peer"):
        data_channel.read_status(extra)
    with _client(server) as client:  # refused at its hello: this call is streamed over gRPC instead
        client.put(NS, b"k", b"v")
        assert client.get(NS, b"k") == b"v"
    _wait_served(server, {("Put", "OK"): 1, ("Get", "OK"): 1, ("DataPut", "OK"): 0})
    for sock in held:
        sock.close()


def test_requests_in_flight_are_counted_once_for_both_transports(start_server):
    """A host may have server.max_streams_per_peer requests in flight, gRPC streams and data-channel requests
    together (each transport used to count its own, so a host could have twice the limit)."""
    server = start_server(max_streams_per_client=2, max_streams_per_peer=2, stream_idle_timeout_s=30)
    stalled = _raw(server, token="")  # a data-channel put in flight, stalled half-way through its payload
    stalled.sendall(data_channel.put_request(NS, [data_channel.PutEntry(b"half", MiB, ChunkMeta())]) + bytes(1000))
    wait_for(lambda: _held(server) == 1, what="the stalled data-channel put in flight")
    release = threading.Event()

    def stalled_frames():  # a gRPC Put stream in flight, stalled after its header
        yield pb.PutFrame(header=pb.ChunkHeader(namespace=NS, key=b"never", size_bytes=MiB))
        release.wait(30)
    channel = grpc.insecure_channel(server.url.removeprefix("grpc://"))
    stalled_put = pb_grpc.TierCacheStub(channel).Put.future(stalled_frames(), timeout=60)
    try:
        wait_for(lambda: _held(server) == 2, what="the stalled gRPC Put in flight too")
        with _client(server) as remote, _client(server, data_channel=False) as streamed:
            for client in (remote, streamed):
                with pytest.raises(CapacityExceeded, match="max_streams_per_peer"):
                    client.put(NS, b"k", bytes(100_000))
                with pytest.raises(CapacityExceeded, match="max_streams_per_peer"):
                    client.get(NS, b"k")
            stalled.close()
            release.set()
            wait_for(lambda: _held(server) == 0, what="the stalled requests to end")
            remote.put(NS, b"k", bytes(100_000))
            assert streamed.get(NS, b"k") == bytes(100_000)
    finally:
        release.set()
        stalled_put.cancel()
        channel.close()
    _wait_served(server, {("DataPut", "RESOURCE_EXHAUSTED"): 1, ("DataGet", "RESOURCE_EXHAUSTED"): 1,
                          ("Put", "RESOURCE_EXHAUSTED"): 1, ("Get", "RESOURCE_EXHAUSTED"): 1})


def _held(server) -> int:
    """Requests in flight from this host (data channel and gRPC streams together)."""
    return server.intake.limits.peers.held("127.0.0.1")


def test_a_trickling_put_is_ended_before_it_completes(start_server):
    server = start_server(stream_idle_timeout_s=1)
    sock = _raw(server, token="")
    sock.sendall(data_channel.put_request(NS, [data_channel.PutEntry(b"trickle", 2 * MiB, ChunkMeta())]))
    ended = time.monotonic() + 30
    with pytest.raises(OSError):  # 1 KiB every 0.2 s would take ten minutes; the server gives it ~2 s
        while time.monotonic() < ended:
            sock.sendall(bytes(1024))
            time.sleep(0.2)
    with _client(server) as client:
        assert client.get(NS, b"trickle") is None


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


class _Tricklers:
    """Raw data-channel connections that each send their first bytes and then one byte at a time (the next of
    `then`, zeros after it), every `every_s`, for as long as the server keeps them; `ended[name]` is how long each
    lasted from its first byte."""

    def __init__(self, port: int, every_s: float = 0.25) -> None:
        self.port = port
        self.every_s = every_s
        self.open: dict[str, tuple[socket.socket, float, bytearray]] = {}
        self.ended: dict[str, float] = {}

    def start(self, name: str, first: bytes, then: bytes = b"", token: str | None = "") -> None:
        sock = _connect(self.port, token)
        sock.setblocking(False)
        sock.send(first)
        self.open[name] = (sock, time.monotonic(), bytearray(then))

    def step(self) -> None:
        """Send every open connection one more byte; note those the server closed."""
        for name, (sock, began, then) in list(self.open.items()):
            try:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable and not sock.recv(65536):
                    raise ConnectionResetError
                sock.send(bytes(then[:1]) or b"\0")
                del then[:1]
            except OSError:  # reset, broken pipe, or a status before the close: the server ended it
                self.ended[name] = time.monotonic() - began
                del self.open[name]
                sock.close()
        time.sleep(self.every_s)

    def trickle_until_ended(self, names, give_up_s: float = 60) -> None:
        until = time.monotonic() + give_up_s
        while any(name in self.open for name in names) and time.monotonic() < until:
            self.step()

    def close(self) -> None:
        for sock, _, _ in self.open.values():
            sock.close()


def test_hostile_clients_are_cut_off_by_deadlines_and_hold_memory_only_for_what_they_sent(tmp_path):
    """A hostile run against a real server process: clients that declare large header blocks, large puts
    and refused payloads, then trickle a byte at a time. Each part of a request has a deadline (a header block
    within one idle timeout, a drained payload at 1 MiB per idle timeout), and the server's memory follows the bytes
    that arrived, not the sizes declared (16 MiB blocks and 64 MiB chunks the arena cannot take: 656 MiB here)."""
    idle_s, hostile = 2.0, 8
    config = tmp_path / "tiercache.yaml"
    config.write_text(f"server:\n  stream_idle_timeout_s: {idle_s}\n  max_chunk_bytes: 64MiB\n"
                      "host:\n  capacity_bytes: 16MiB\n")
    port = free_port()
    with ServerProcess("--config", str(config), "--data-port", str(port)) as proc, \
            Client.from_url(proc.url, same_host=False, timeout_s=30) as client:
        warm = bytes(range(256)) * (16 * 1024)
        client.put(NS, b"warm", warm)
        assert client.get(NS, b"warm") == warm
        baseline = _rss_bytes(proc.process.pid)
        tricklers = _Tricklers(port)
        try:
            for i in range(hostile):
                tricklers.start(f"block-{i}",
                                struct.pack("<BII", data_channel.OP_GET, 1, data_channel.MAX_BLOCK_BYTES) + b"\0")
                tricklers.start(f"put-{i}", data_channel.put_request(NS, [data_channel.PutEntry(b"big-%d" % i, 64 * MiB,
                                                                                ChunkMeta())]) + b"\0")
            for i in range(hostile // 2):  # an unknown object class: refused, its 4 MiB drained
                tricklers.start(f"drain-{i}", data_channel.put_request(NS, [data_channel.PutEntry(b"bad", 4 * MiB,
                                                                                  ChunkMeta(9))]) + b"\0")
            peak = baseline
            give_up = time.monotonic() + 60
            while any(not name.startswith("put") for name in tricklers.open) and time.monotonic() < give_up:
                tricklers.step()
                peak = max(peak, _rss_bytes(proc.process.pid))
            margin_s = 5.0  # a loaded machine; without the deadlines these would trickle for days
            blocks = {n: t for n, t in tricklers.ended.items() if n.startswith("block")}
            drains = {n: t for n, t in tricklers.ended.items() if n.startswith("drain")}
            assert len(blocks) == hostile and max(blocks.values()) < idle_s + margin_s, blocks
            assert len(drains) == hostile // 2 and max(drains.values()) < 4 * idle_s + margin_s, drains
            # The puts may trickle on (64 MiB at 1 MiB per idle timeout), each holding what it received and a step.
            assert peak - baseline < 64 * MiB, f"server RSS grew {(peak - baseline) / MiB:.0f} MiB"
            assert client.get(NS, b"warm") == warm
        finally:
            tricklers.close()


def test_a_trickled_tls_handshake_is_ended_within_the_idle_timeout(start_server, tmp_path):
    pki = make_pki(tmp_path)
    idle_s = 1.0
    server = start_server(stream_idle_timeout_s=idle_s, security=SecurityConfig(tls_cert_file=pki.server_cert,
                                                                                tls_key_file=pki.server_key))
    outgoing = ssl.MemoryBIO()
    client = ssl.create_default_context(cafile=pki.ca).wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    client_hello = outgoing.read()  # a real ClientHello, sent a byte every 0.25 s: two minutes' worth
    tricklers = _Tricklers(server.data_port)
    try:
        tricklers.start("tls", client_hello[:1], then=client_hello[1:], token=None)
        tricklers.trickle_until_ended(["tls"], give_up_s=30)
        assert tricklers.ended["tls"] < idle_s + 5.0  # a loaded machine's margin
    finally:
        tricklers.close()
    with _client(server, tls_ca_file=pki.ca) as client:
        client.put(NS, b"k", b"after")
        assert client.get(NS, b"k") == b"after"


def test_a_stored_chunk_is_served_by_every_path_while_stalled_puts_take_the_arena(tmp_path):
    """While stalled 64 MiB puts held reservations in the host arena, a 4 KiB chunk stored earlier used to be read
    fine one moment and a miss the next. Each reservation evicts what the arena holds, and a victim
    was in no tier from the moment it left the arena's index until the store had written it to disk: every path
    missed it then (gRPC too; ~30 misses in 2,000 reads here). Here the stalled puts come and go for a few seconds,
    so the arena evicts again and again (and the reads promote the chunk back in), while the chunk is read through
    gRPC, the data channel and the same-host path: a chunk on its way down must be found at every moment."""
    config = tmp_path / "tiercache.yaml"
    config.write_text("server:\n  stream_idle_timeout_s: 60\n  max_chunk_bytes: 64MiB\n")
    port = free_port()
    small = os.urandom(4096)
    stop = threading.Event()

    def stalled_puts(n: int) -> None:  # a 64 MiB put that sends 1000 bytes and stalls; again every 0.3 s
        for attempt in itertools.count():
            if stop.is_set():
                return
            with _connect(port, token="") as sock:
                entry = data_channel.PutEntry(b"stalled-%d-%d" % (n, attempt), 64 * MiB - 200, ChunkMeta())
                sock.sendall(data_channel.put_request(NS, [entry]) + bytes(1000))
                stop.wait(0.3)

    # --disk-fsync: a demotion takes a while, as on a loaded disk, so a read that falls between tiers is likely.
    with ServerProcess("--config", str(config), "--data-port", str(port), "--host-mem", "160MiB",
                       "--disk-fsync") as proc, \
            Client.from_url(proc.url, same_host=False, data_channel=False, timeout_s=30) as streamed, \
            Client.from_url(proc.url, same_host=False, timeout_s=30) as remote, \
            Client.from_url(proc.url, same_host=True, timeout_s=30) as local:
        remote.put(NS, b"small", small)
        remote.put_many(NS, [(b"filler-%d" % i, bytes(2 * MiB)) for i in range(20)])
        stallers = [threading.Thread(target=stalled_puts, args=(n,), daemon=True) for n in range(4)]
        for thread in stallers:
            thread.start()
        missed, reads = collections.Counter(), 0
        try:
            until = time.monotonic() + 8
            while time.monotonic() < until:
                for path, client in (("grpc", streamed), ("data channel", remote), ("same-host", local)):
                    reads += 1
                    if client.get(NS, b"small") != small:
                        missed[path] += 1
        finally:
            stop.set()
            for thread in stallers:
                thread.join()
        assert local.same_host and reads > 30
        assert not missed, f"{sum(missed.values())} of {reads} reads missed a stored chunk: {dict(missed)}"


def test_a_get_that_fails_half_way_closes_the_connection_and_the_client_retries(start_server, monkeypatch):
    server = start_server()
    with _client(server, retry=RetryPolicy(attempts=3, backoff=Backoff(0.01, 1.0))) as client:
        items = [(b"k%d" % i, b"value %d" % i) for i in range(SERVE_BATCH + 1)]  # two batches
        client.put_many(NS, items)
        pin = server.same_host.pin
        failures = []

        def failing_once(keys):
            if keys[-1].key == items[-1][0] and not failures:  # the second batch, after the first was sent
                failures.append(keys)
                raise OSError("a tier failed")
            return pin(keys)
        monkeypatch.setattr(server.same_host, "pin", failing_once)
        got = client.get_many(NS, [k for k, _ in items])
        assert [f.data for f in got] == [v for _, v in items]  # the retry, on a new connection
        assert failures


def test_unix_socket_clients_of_a_tls_server_use_the_plaintext_unix_data_channel(start_server, tmp_path):
    pki = make_pki(tmp_path)
    path = str(tmp_path / "tc.sock")
    server = start_server(unix_socket=path, security=SecurityConfig(tls_cert_file=pki.server_cert,
                                                                     tls_key_file=pki.server_key))
    with Client.from_url(f"grpc+unix://{path}", same_host=False, retry=RetryPolicy(attempts=1)) as client:
        client.put(NS, b"k", b"local")
        assert client.get(NS, b"k") == b"local"
    _wait_served(server, {("DataPut", "OK"): 1, ("DataGet", "OK"): 1})


def test_stopping_the_server_ends_idle_tls_connections(start_server, tmp_path):
    pki = make_pki(tmp_path)
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key))
    client = _client(server, tls_ca_file=pki.ca)
    client.put(NS, b"k", b"v")  # leaves an idle TLS connection in the pool, its server thread in recv
    assert server.data_listener.open_connections()
    server.stop(grace_s=5)
    assert not server.data_listener.serving_threads()  # every connection's thread ended
    client.close()


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n",  # not a data-channel client
    data_channel.hello("") + struct.pack("<BII", 9, 1, 0),  # an unknown op
    data_channel.hello("") + struct.pack("<BII", data_channel.OP_GET, 1, 3) + b"abc",  # a block that does not parse
    data_channel.hello("") + data_channel.put_request(NS, [PutEntry(b"k", 1 << 40, ChunkMeta())]),  # too large
    data_channel.hello("") + data_channel.put_request(NS, [PutEntry(b"k", 1, ChunkMeta(9))]) + b"x",  # an unknown class
])
def test_malformed_input_is_answered_and_the_server_serves_on(start_server, garbage):
    server = start_server()
    sock = _raw(server)
    sock.sendall(garbage)
    with pytest.raises(TierCacheError):
        data_channel.read_status(sock)
        data_channel.read_status(sock)
    with _client(server) as client:
        client.put(NS, b"after", b"fine")
        assert client.get(NS, b"after") == b"fine"


# -- connections that come and go -----------------------------------------------------------------------------------

def test_a_pooled_connection_the_server_closed_is_replaced_transparently(start_server, monkeypatch):
    monkeypatch.setattr(tiercache.server.data_channel, "DATA_KEEPALIVE_S", 0.2)
    server = start_server()
    with _client(server) as client:  # one try: a retry would hide a failure
        client.put(NS, b"k", b"first")
        wait_for(lambda: not server.data_listener.open_connections(), what="the server to close the idle connection")
        assert client.get(NS, b"k") == b"first"


def test_a_restarted_server_on_another_data_port_is_found_again(tmp_path):
    proc = ServerProcess("--host-mem", "64MiB").start()
    try:
        with Client.from_url(proc.url, same_host=False, timeout_s=20) as client:
            client.put(NS, b"k", b"before")
            first = client.paths.data_channel.address
            proc.kill()
            proc.start()
            client.put(NS, b"k", b"after")
            assert client.get(NS, b"k") == b"after"
            assert client.paths.data_channel.address != first
    finally:
        proc.kill()


def test_an_unreachable_data_port_falls_back_to_grpc_and_is_tried_again_later(start_server, caplog):
    server = start_server()
    server.data_listener.stop()  # the port the server announces now refuses connections: a firewall, a Service
    now = [1000.0]
    with _client(server) as client, caplog.at_level(logging.WARNING, logger="tiercache.client.chooser"):
        client.paths.clock = lambda: now[0]
        client.put(NS, b"k", b"streamed instead")
        assert client.get(NS, b"k") == b"streamed instead"
        def warnings() -> int:
            return len([r for r in caplog.records if "streaming payloads over gRPC for" in r.getMessage()])
        assert warnings() == 1  # once, not per call
        now[0] += chooser.DATA_CHANNEL_RETRY_S - 1
        client.put(NS, b"k1", b"still streamed")
        assert warnings() == 1
        now[0] += 1
        client.put(NS, b"k2", b"again")  # the wait is over: the data channel is asked for (and refused) again
        assert warnings() == 2
    _wait_served(server, {("Put", "OK"): 3, ("Get", "OK"): 1})


def test_data_port_is_configurable(start_server):
    port = free_port()
    server = start_server(data_port=port)
    assert server.data_port == port
    with _client(server) as client:
        client.put(NS, b"k", b"v")
