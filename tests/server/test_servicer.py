"""The real client against a real server on a free port (and a real redis-server where Redis matters)."""

from __future__ import annotations

import os
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import free_port, wait_for
from tiercache.client import Client
from tiercache.client import Backoff, RetryPolicy
from tiercache.config import KiB, MiB
from tiercache.errors import CapacityExceeded, InvalidArgument, Unavailable
from tiercache.protocol.wire import SERVICE_NAME, pb, pb_grpc

NS = "test-model@main/kv-bf16-N544-u16"


@pytest.fixture
def server(start_server):
    return start_server(max_chunk_bytes=8 * MiB)


@pytest.fixture(params=[True, False], ids=["same-host", "grpc"])
def client(server, request):
    """Both data paths: payloads through the shared-memory arena, and streamed over gRPC."""
    with Client.from_url(server.url, same_host=request.param) as c:
        assert c.same_host is request.param
        yield c


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(server.url.removeprefix("grpc://"),
                                    options=[("grpc.max_send_message_length", 64 * MiB)])
    yield pb_grpc.TierCacheStub(channel)
    channel.close()


@pytest.mark.parametrize("size", [0, 1, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1, 4 * MiB + 3])
def test_round_trip_is_byte_identical(client, size):
    data = os.urandom(size)
    assert client.put(NS, b"k", data) == "host"
    assert client.get(NS, b"k") == data


def test_get_many_keeps_order_with_misses_and_repeats(client):
    client.put(NS, b"a", b"A" * 3000)
    client.put(NS, b"b", b"B" * (2 * MiB))
    got = client.get_many(NS, [b"b", b"zz", b"a", b"b"])
    assert [f and f.data for f in got] == [b"B" * (2 * MiB), None, b"A" * 3000, b"B" * (2 * MiB)]
    assert client.get_many(NS, []) == []


def test_exists_locate_delete(client):
    client.put(NS, b"a", b"1")
    assert client.exists(NS, [b"a", b"b"]) == [True, False]
    assert client.locate(NS, [b"a", b"b"]) == ["host", None]
    assert client.delete(NS, [b"a", b"b"]) == 1
    assert client.get(NS, b"a") is None


def test_namespaces_do_not_share_keys(client):
    client.put("ns-a", b"k", b"a")
    assert client.get("ns-b", b"k") is None


@pytest.mark.parametrize("data_channel, put_method", [(False, "Put"), (True, "DataPut")])
def test_stats_and_metrics(start_server, data_channel, put_method):
    server = start_server(max_chunk_bytes=8 * MiB, metrics_port=0)
    client = Client.from_url(server.url, same_host=False, data_channel=data_channel)
    client.put(NS, b"a", b"x" * 5000)
    client.get(NS, b"a")
    client.get(NS, b"missing")
    stats = client.stats()
    host = stats["tiers"][0]
    assert host["name"] == "host" and host["chunks"] == 1 and host["hits"] == 1 and host["up"]
    assert stats["namespaces"] == [{"namespace": NS, "used_bytes": host["used_bytes"], "chunks": 1}]
    assert stats["max_chunk_bytes"] == 8 * MiB
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    for name in ("tiercache_tier_hits_total", "tiercache_tier_misses_total", "tiercache_tier_used_bytes",
                 "tiercache_tier_capacity_bytes", "tiercache_tier_evictions_total", "tiercache_tier_promotions_total",
                 "tiercache_tier_checksum_failures_total", "tiercache_rpc_duration_seconds_bucket"):
        assert name in text, name
    assert 'tiercache_tier_hits_total{tier="host"} 1.0' in text
    assert 'tiercache_requests_in_flight{tenant="open"} 0.0' in text  # every request ended (one per tenant)
    assert f'tiercache_rpc_duration_seconds_count{{code="OK",method="{put_method}"}} 1.0' in text


def test_health_service_reports_serving(server):
    with grpc.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING


# -- malformed requests: the documented status code, and the server keeps serving ---------------------------------

def _put(stub, frames):
    with pytest.raises(grpc.RpcError) as info:
        stub.Put(iter(frames), timeout=10)
    return info.value.code()


def header(size, namespace=NS, key=b"k"):
    return pb.PutFrame(header=pb.ChunkHeader(namespace=namespace, key=key, size_bytes=size))


def data(n):
    return pb.PutFrame(data=b"x" * n)


@pytest.mark.parametrize("frames,code", [
    ([data(10)], grpc.StatusCode.INVALID_ARGUMENT),                          # data before any header
    ([header(10), data(5)], grpc.StatusCode.INVALID_ARGUMENT),               # stream ends mid-chunk
    ([header(10), data(11)], grpc.StatusCode.INVALID_ARGUMENT),              # more bytes than announced
    ([header(10), data(5), header(3)], grpc.StatusCode.INVALID_ARGUMENT),    # next header before data complete
    ([pb.PutFrame()], grpc.StatusCode.INVALID_ARGUMENT),                      # empty frame
    ([header(9 * MiB)], grpc.StatusCode.INVALID_ARGUMENT),                   # over max chunk size
    ([header(1, key=b"")], grpc.StatusCode.INVALID_ARGUMENT),                # empty key
    ([header(1, key=b"k" * 65)], grpc.StatusCode.INVALID_ARGUMENT),          # oversize key
    ([header(1, namespace="")], grpc.StatusCode.INVALID_ARGUMENT),           # empty namespace
    ([header(1, namespace="n" * 257)], grpc.StatusCode.INVALID_ARGUMENT),    # oversize namespace
    ([header(1, namespace="bad\x00ns")], grpc.StatusCode.INVALID_ARGUMENT),  # unprintable namespace
])
def test_malformed_put_gets_its_status_code(stub, client, frames, code):
    assert _put(stub, frames) == code
    client.put(NS, b"after", b"still fine")
    assert client.get(NS, b"after") == b"still fine"


def test_whole_chunk_in_one_frame_is_accepted(stub, client):
    payload = os.urandom(5 * MiB)
    stub.Put(iter([header(len(payload)), pb.PutFrame(data=payload)]), timeout=10)
    assert client.get(NS, b"k") == payload


def test_several_chunks_in_one_stream(stub, client):
    response = stub.Put(iter([header(3, key=b"a"), data(3), header(0, key=b"b"), header(2, key=b"c"), data(2)]))
    assert list(response.stored_in) == ["host"] * 3
    assert [f.data for f in client.get_many(NS, [b"a", b"b", b"c"])] == [b"xxx", b"", b"xx"]


@pytest.mark.parametrize("namespace,keys", [("", [b"k"]), (NS, [b""]), (NS, [b"k" * 65]), ("n" * 300, [b"k"])])
def test_malformed_key_requests(stub, namespace, keys):
    for call in (stub.Exists, stub.Delete):
        with pytest.raises(grpc.RpcError) as info:
            call(pb.KeysRequest(namespace=namespace, keys=keys), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Get(pb.GetRequest(namespace=namespace, keys=keys), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_garbage_bytes_do_not_hurt_the_server(server, client):
    with grpc.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        raw = channel.unary_unary(f"/{SERVICE_NAME}/Exists", request_serializer=None, response_deserializer=None)
        for blob in (b"\xff" * 10, os.urandom(1000), b"\x0a\xff\xff\xff\xff\x0f"):
            with pytest.raises(grpc.RpcError) as info:
                raw(blob, timeout=5)
            assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    client.put(NS, b"k", b"ok")
    assert client.get(NS, b"k") == b"ok"


def test_chunk_larger_than_every_tier(start_server):
    server = start_server(host_bytes=1 * MiB, disk_bytes=2 * MiB, max_chunk_bytes=8 * MiB)
    with Client.from_url(server.url) as client:
        with pytest.raises(CapacityExceeded):
            client.put(NS, b"big", b"x" * (4 * MiB))


def test_client_side_validation():
    client = Client.from_url("grpc://127.0.0.1:1")
    with pytest.raises(InvalidArgument):
        client.put(NS, b"", b"x")
    with pytest.raises(InvalidArgument):
        Client.from_url("http://127.0.0.1:80")


def test_unreachable_server_is_unavailable_after_retries():
    client = Client.from_url(f"grpc://127.0.0.1:{free_port()}", timeout_s=2,
                             retry=RetryPolicy(attempts=3, backoff=Backoff(0.01, 1.0)))
    with pytest.raises(Unavailable):
        client.get(NS, b"k")


def test_redis_killed_mid_run(start_server, redis_proc):
    server = start_server(host_bytes=2 * MiB, disk_bytes=4 * MiB, redis_url=redis_proc.url, write_through=True)
    chunks = {b"c%d" % i: os.urandom(512 * KiB) for i in range(8)}
    with Client.from_url(server.url) as client:
        for k, v in chunks.items():
            client.put(NS, k, v)
        redis_proc.kill()
        for k, v in chunks.items():  # all held by host and disk: no client error
            assert client.get(NS, k) == v
        client.put(NS, b"during-outage", b"y" * 1000)
        assert client.get(NS, b"during-outage") == b"y" * 1000
        redis_tier = client.stats()["tiers"][2]
        assert redis_tier["name"] == "redis" and not redis_tier["up"]
        redis_proc.start()
        wait_for(lambda: client.stats()["tiers"][2]["up"], timeout_s=5, what="redis tier back up")
        client.put(NS, b"after-restart", b"z")
        assert redis_proc.client().dbsize() == 1


@pytest.mark.parametrize("path", ["grpc", "data channel", "same host"])
def test_a_chunk_past_the_limit_names_the_flag_that_raises_it(start_server, path):
    server = start_server(max_chunk_bytes=1 * MiB)
    options = {"grpc": {"same_host": False, "data_channel": False}, "data channel": {"same_host": False},
               "same host": {}}[path]
    with Client.from_url(server.url, **options) as client:
        with pytest.raises(InvalidArgument, match=r"chunk of 2097152 bytes \(2\.0 MiB\) exceeds the server's maximum "
                                                  r"of 1048576 \(1\.0 MiB\): raise it with `tiercache serve "
                                                  r"--max-chunk-size` \(server\.max_chunk_bytes\)"):
            client.put(NS, b"big", bytes(2 * MiB))
        client.put(NS, b"k", b"ok")  # the client goes on
        assert client.get(NS, b"k") == b"ok"
