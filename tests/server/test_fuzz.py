"""More than 10,000 malformed requests over a real gRPC channel: random bytes as messages, out-of-range sizes, wrong
and huge namespaces and keys, broken Put streams, unknown leases. Each class gets its documented status code, nothing
gets INTERNAL or UNKNOWN, and afterwards the server is healthy and a round trip returns the right bytes."""

from __future__ import annotations

import collections
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiercache.client import Client
from tiercache.config import MiB
from tiercache.protocol.wire import SERVICE_NAME, pb

ROUNDS = 10_500
UNARY = {"Exists": "KeysRequest", "Delete": "KeysRequest", "Stats": "StatsRequest", "ReportDelivery": "DeliveryReport",
         "Attach": "AttachRequest", "Reserve": "ReserveRequest", "Commit": "LeaseIds", "Abort": "LeaseIds",
         "Acquire": "KeysRequest", "Release": "LeaseIds", "Lookup": "LookupRequest"}
OK, INVALID, NOT_FOUND, EXHAUSTED = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
# Random bytes that happen to decode are valid (if odd) requests: they may succeed, miss, or be refused as invalid.
RANDOM_BYTES_OK = {OK, INVALID, NOT_FOUND, EXHAUSTED}


def _raw(channel: grpc.Channel, method: str, kind: str):
    path = f"/{SERVICE_NAME}/{method}"
    return getattr(channel, kind)(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            for _ in result:
                pass
        return OK
    except grpc.RpcError as exc:
        return exc.code()


def _random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300, 4096]))


def _namespace(rng: random.Random) -> str:
    return rng.choice(["", "x" * rng.randint(300, 5000), "bad\x00ns", "tab\tns", "\u2028", "ok-namespace"])


def _key(rng: random.Random) -> bytes:
    return rng.choice([b"", rng.randbytes(rng.randint(300, 5000)), rng.randbytes(rng.randint(1, 64))])


def _bad_namespace_or_key(rng: random.Random, count: int = 0) -> tuple[str, list[bytes]]:
    """A namespace and `count` keys (default 1-3) of which at least one is invalid."""
    while True:
        namespace, keys = _namespace(rng), [_key(rng) for _ in range(count or rng.randint(1, 3))]
        if namespace != "ok-namespace" or any(len(k) == 0 or len(k) > 256 for k in keys):
            return namespace, keys


def _put_stream(rng: random.Random, max_chunk: int) -> tuple[list[bytes], grpc.StatusCode]:
    """A broken Put stream and the code it must get."""
    header = pb.ChunkHeader(namespace="ok-namespace", key=b"k" * 18, size_bytes=1000)
    data = pb.PutFrame(data=b"x" * 600).SerializeToString()
    head = pb.PutFrame(header=header).SerializeToString()
    case = rng.randrange(7)
    if case == 0:  # data before any header
        return [data], INVALID
    if case == 1:  # a second header before the first chunk is complete
        return [head, data, head], INVALID
    if case == 2:  # truncated: the stream ends before the announced size
        return [head, data], INVALID
    if case == 3:  # more bytes than announced
        return [head, data, data], INVALID
    if case == 4:  # announced size above the maximum
        big = pb.ChunkHeader(namespace="ok-namespace", key=b"k" * 18, size_bytes=max_chunk + rng.randint(1, 1 << 40))
        return [pb.PutFrame(header=big).SerializeToString()], INVALID
    if case == 5:  # an empty frame (neither header nor data)
        return [b""], INVALID
    namespace, keys = _bad_namespace_or_key(rng, count=1)  # a bad namespace or key in the header
    bad = pb.ChunkHeader(namespace=namespace, key=keys[0], size_bytes=10)
    return [pb.PutFrame(header=bad).SerializeToString(), pb.PutFrame(data=b"y" * 10).SerializeToString()], INVALID


def _lookup(rng: random.Random) -> bytes:
    """A Lookup request with random shapes, lengths and hashes: answered or refused as invalid, never an error."""
    groups = [pb.LayerGroupShape(kind=rng.choice([0, 1, 2, 2, 7]), window=rng.choice([0, 0, 1, 40]))
              for _ in range(rng.choice([0, 1, 2, 3, 300]))]
    prompt_tokens = rng.choice([0, 1, 2, 100, 5000, 1 << 40])
    n = rng.choice([0, 1, 16, 32])
    count = (max(prompt_tokens - 1, 0) // n + 1) if n and prompt_tokens < 10_000 else rng.randint(0, 3)
    boundaries = rng.randbytes(16 * count + rng.choice([0, 0, 0, 1, 15]))
    positions = [pb.PositionHash(position=rng.choice([0, 1, 7, 99, 1 << 50]), hash=rng.randbytes(rng.choice([16, 3])))
                 for _ in range(rng.randint(0, 3))]
    return pb.LookupRequest(namespace=rng.choice(["ok-namespace", ""]), chunk_tokens=n, groups=groups,
                            prompt_tokens=prompt_tokens, boundaries=boundaries, positions=positions,
                            rank_namespaces=rng.choice([[], ["ok-other"], ["bad\x00"]]),
                            last_chunk_tokens=rng.randbytes(rng.choice([0, 0, 3, 4 * rng.randint(1, 40)])),
                            match_unit=rng.choice([0, 1, 8, 16, 7]), report=rng.random() < 0.5).SerializeToString()


def _one_request(rng: random.Random, channel: grpc.Channel, max_chunk: int) -> tuple[str, grpc.StatusCode, set]:
    """Send one malformed request; returns (class, code received, codes allowed)."""
    choice = rng.randrange(8)
    if choice == 7:
        request = _lookup(rng)
        return "odd Lookup", _code(lambda: _raw(channel, "Lookup", "unary_unary")(request, timeout=10)), {OK, INVALID}
    if choice == 0:
        method = rng.choice(list(UNARY))
        payload = _random_bytes(rng)
        return "random bytes, unary", _code(lambda: _raw(channel, method, "unary_unary")(payload, timeout=10)), \
            RANDOM_BYTES_OK
    if choice == 1:
        frames = [_random_bytes(rng) for _ in range(rng.randint(1, 4))]
        return "random bytes, Put stream", _code(lambda: _raw(channel, "Put", "stream_unary")(iter(frames),
                                                                                              timeout=10)), \
            RANDOM_BYTES_OK
    if choice == 2:
        payload = _random_bytes(rng)
        return "random bytes, Get", _code(lambda: _raw(channel, "Get", "unary_stream")(payload, timeout=10)), \
            RANDOM_BYTES_OK
    if choice == 3:
        namespace, keys = _bad_namespace_or_key(rng)
        method = rng.choice(["Exists", "Delete", "Acquire"])
        request = pb.KeysRequest(namespace=namespace, keys=keys).SerializeToString()
        return "bad namespace or key", _code(lambda: _raw(channel, method, "unary_unary")(request, timeout=10)), \
            {INVALID}
    if choice == 4:
        frames, expected = _put_stream(rng, max_chunk)
        return "broken Put stream", _code(lambda: _raw(channel, "Put", "stream_unary")(iter(frames), timeout=10)), \
            {expected}
    if choice == 5:
        ids = [rng.getrandbits(64) for _ in range(rng.randint(1, 3))]
        method = rng.choice(["Commit", "Abort", "Release"])
        request = pb.LeaseIds(lease_ids=ids).SerializeToString()
        # Commit of an unknown lease is NOT_FOUND; Abort / Release of one are no-ops (idempotent).
        allowed = {NOT_FOUND} if method == "Commit" else {OK}
        return f"unknown lease ({method})", _code(lambda: _raw(channel, method, "unary_unary")(request, timeout=10)), \
            allowed
    reason = "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 12)))
    report = pb.DeliveryReport(namespace="ok-namespace", delivered=pb.DeliveryTotals(
        saves_dropped_by_reason={reason: rng.randint(1, 9)})).SerializeToString()
    return "delivery report with an unknown reason for dropped saves", \
        _code(lambda: _raw(channel, "ReportDelivery", "unary_unary")(report, timeout=10)), {INVALID}


def test_ten_thousand_malformed_requests(start_server):
    server = start_server(host_bytes=16 * MiB, disk_bytes=0, max_chunk_bytes=4 * MiB)
    rng = random.Random(20261122)
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    target = server.url.removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        for _ in range(ROUNDS):
            name, code, allowed = _one_request(rng, channel, 4 * MiB)
            seen[name][code.name] += 1
            assert code in allowed, f"{name}: got {code.name}, expected one of {sorted(c.name for c in allowed)}"
        assert sum(sum(c.values()) for c in seen.values()) >= 10_000
        print({name: dict(codes) for name, codes in seen.items()})  # the tally, with -s
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert seen["random bytes, unary"]["INVALID_ARGUMENT"] > 0  # undecodable bytes are INVALID_ARGUMENT, not INTERNAL
    with Client.from_url(server.url) as client:
        payload = random.Random(1).randbytes(3 * MiB)
        client.put("ok-namespace", b"after the storm", payload)
        assert client.get("ok-namespace", b"after the storm") == payload
    internal = [s for metric in server.metrics.registry.collect() if metric.name == "tiercache_rpc_duration_seconds"
                for s in metric.samples if s.name.endswith("_count") and s.labels["code"] in ("INTERNAL", "UNKNOWN")]
    assert not internal, internal


@pytest.mark.parametrize("cancel_after_frames", [0, 1, 3])
def test_a_put_stream_cancelled_midway_stores_nothing_and_blocks_no_one(start_server, cancel_after_frames):
    server = start_server(host_bytes=16 * MiB, disk_bytes=0)
    target = server.url.removeprefix("grpc://")
    header = pb.PutFrame(header=pb.ChunkHeader(namespace="ns", key=b"half", size_bytes=4 * MiB)).SerializeToString()
    frames = [header] + [pb.PutFrame(data=bytes(1 * MiB)).SerializeToString()] * cancel_after_frames

    def stream():
        yield from frames
        raise _Cancelled()  # the client dies mid-stream: grpc cancels the call

    with grpc.insecure_channel(target) as channel:
        put = _raw(channel, "Put", "stream_unary")
        with pytest.raises((grpc.RpcError, _Cancelled)):
            put(stream(), timeout=10)
    with Client.from_url(server.url) as client:
        assert client.get("ns", b"half") is None
        client.put("ns", b"whole", b"z" * 1000)
        assert client.get("ns", b"whole") == b"z" * 1000


class _Cancelled(Exception):
    pass
