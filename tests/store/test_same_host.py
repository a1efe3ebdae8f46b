"""The same-host path: payloads through the server's shared-memory arena, leases that expire, pins that hold. A client
chooses the arena for large calls only (client.chooser): these tests insist on it (same_host=True)."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from tests.helpers import wait_for
from tiercache.client import Client
from tiercache.client.shared_arena import SharedArena
from tiercache.config import MiB
from tiercache.errors import InvalidArgument, NotFound, Unavailable
from tiercache.protocol.wire import pb, pb_grpc

NS = "same-host"


def raw_stub(server):
    return pb_grpc.TierCacheStub(grpc.insecure_channel(server.url.removeprefix("grpc://")))


def test_a_local_client_attaches_by_itself(start_server):
    server = start_server()
    with Client.from_url(server.url) as client:
        assert client.same_host
        data = os.urandom(3 * MiB + 5)
        assert client.put(NS, b"k", data) == "host"
        assert client.get(NS, b"k") == data


def test_no_arena_means_grpc_and_same_host_true_is_an_error(start_server):
    server = start_server(shared_memory=False)
    with Client.from_url(server.url) as client:
        assert not client.same_host
        client.put(NS, b"k", b"streamed")
        assert client.get(NS, b"k") == b"streamed"
    with pytest.raises(Unavailable):
        Client.from_url(server.url, same_host=True).put(NS, b"k", b"x")


def test_get_many_fills_caller_buffers(start_server):
    server = start_server()
    with Client.from_url(server.url, same_host=True) as client:
        chunks = {b"a": os.urandom(MiB), b"b": os.urandom(1000)}
        client.put_many(NS, [(k, v) for k, v in chunks.items()])
        buffers = [bytearray(MiB), bytearray(MiB), bytearray(10)]
        got = client.get_many(NS, [b"a", b"b", b"missing"], buffers)
        assert [f and f.tier for f in got] == ["host", "host", None]
        assert got[1].data.obj is buffers[1] and len(got[1].data) == 1000  # a view of the buffer, the chunk's size
        assert bytes(buffers[0]) == chunks[b"a"] and bytes(buffers[1][:1000]) == chunks[b"b"]
        with pytest.raises(InvalidArgument):
            client.get_many(NS, [b"a"], [bytearray(10)])
        reused = bytearray(MiB)  # the simple get into a reused buffer: a view of it comes back
        for key in (b"a", b"b"):
            view = client.get(NS, key, into=reused)
            assert view.obj is reused and view == chunks[key]
        assert client.get(NS, b"missing", into=reused) is None


def test_acquire_promotes_from_disk(start_server):
    server = start_server(host_bytes=2 * MiB, disk_bytes=16 * MiB)
    with Client.from_url(server.url, same_host=True) as client:
        chunks = {b"c%d" % i: os.urandom(MiB - 100) for i in range(5)}
        for k, v in chunks.items():
            client.put(NS, k, v)
        assert client.locate(NS, [b"c0"]) == ["disk"]
        assert client.get_many(NS, [b"c0"])[0] == (chunks[b"c0"], "disk")
        assert client.locate(NS, [b"c0"]) == ["host"]


def test_chunk_too_large_for_the_arena_goes_the_remote_way(start_server):
    server = start_server(host_bytes=1 * MiB, disk_bytes=16 * MiB)
    with Client.from_url(server.url, same_host=True) as client:
        big = os.urandom(3 * MiB)
        assert client.put(NS, b"big", big) == "disk"  # Reserve refused: sent over the data channel instead
        assert client.get(NS, b"big") == big  # found but not leasable: received over the data channel instead


def test_abandoned_reservation_is_taken_back_when_its_lease_expires(start_server):
    server = start_server(host_bytes=4 * MiB, disk_bytes=16 * MiB, lease_ttl_s=0.3)
    stub = raw_stub(server)
    header = pb.ChunkHeader(namespace=NS, key=b"crashed", size_bytes=3 * MiB)
    stub.Reserve(pb.ReserveRequest(namespace=NS, chunks=[header]))  # ...and the client "crashes"
    with Client.from_url(server.url, same_host=True) as client:
        assert client.put(NS, b"next", os.urandom(3 * MiB)) == "disk"  # the arena is still held
        wait_for(lambda: len(server.leases) == 0, timeout_s=5, what="the reservation to expire")
        assert client.put(NS, b"after", os.urandom(3 * MiB)) == "host"


def test_a_commit_naming_an_unknown_lease_loses_none_of_the_others(start_server):
    server = start_server(lease_ttl_s=60)
    stub = raw_stub(server)
    data = os.urandom(MiB)
    header = pb.ChunkHeader(namespace=NS, key=b"committed", size_bytes=len(data))
    reservation = stub.Reserve(pb.ReserveRequest(namespace=NS, chunks=[header])).reservations[0]
    attach = stub.Attach(pb.AttachRequest())
    arena = SharedArena(attach.path, attach.size_bytes, attach.inode)
    arena.write([(r.offset, r.length) for r in reservation.payload], memoryview(data))
    arena.close()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Commit(pb.LeaseIds(lease_ids=[reservation.lease_id, 12345]))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(server.leases) == 0  # the first was committed before the unknown id was refused, not dropped
    with Client.from_url(server.url, same_host=True) as client:
        assert client.get(NS, b"committed") == data


def test_a_chunk_under_a_read_lease_is_never_overwritten(start_server):
    server = start_server(host_bytes=4 * MiB, disk_bytes=32 * MiB, lease_ttl_s=60)
    with Client.from_url(server.url, same_host=True) as client:
        original = os.urandom(MiB)
        client.put(NS, b"held", original)
        stub = raw_stub(server)
        lease = stub.Acquire(pb.KeysRequest(namespace=NS, keys=[b"held"])).leases[0]
        attach = stub.Attach(pb.AttachRequest())
        arena = SharedArena(attach.path, attach.size_bytes, attach.inode)
        ranges = [(r.offset, r.length) for r in lease.payload]
        for i in range(12):  # 12 MiB through a 4 MiB arena: everything else is evicted around the pinned chunk
            client.put(NS, b"churn-%d" % i, os.urandom(MiB))
        assert arena.read(ranges, lease.size_bytes) == original
        stub.Release(pb.LeaseIds(lease_ids=[lease.lease_id]))
        for i in range(12, 24):
            client.put(NS, b"churn-%d" % i, os.urandom(MiB))
        assert client.locate(NS, [b"held"]) == ["disk"]  # evictable again once released
        assert client.get(NS, b"held") == original
        arena.close()


def test_expired_read_lease_releases_the_pin(start_server):
    server = start_server(host_bytes=2 * MiB, disk_bytes=16 * MiB, lease_ttl_s=0.3)
    with Client.from_url(server.url, same_host=True) as client:
        client.put(NS, b"held", os.urandom(MiB - 100))
        raw_stub(server).Acquire(pb.KeysRequest(namespace=NS, keys=[b"held"]))  # never released
        wait_for(lambda: len(server.leases) == 0, timeout_s=5, what="the read lease to expire")
        for i in range(4):
            client.put(NS, b"churn-%d" % i, os.urandom(MiB - 100))
        assert client.locate(NS, [b"held"]) == ["disk"]


def test_stopping_the_server_removes_its_arena(start_server):
    server = start_server()
    path = server.same_host.arena.path
    assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
    server.stop(grace_s=0)
    assert not os.path.exists(path)


def test_unix_socket_urls(start_server, tmp_path):
    socket_path = str(tmp_path / "tiercache.sock")
    start_server(unix_socket=socket_path)
    with Client.from_url(f"grpc+unix://{socket_path}", same_host=False) as client:
        client.put(NS, b"k", b"over a unix socket")
        assert client.get(NS, b"k") == b"over a unix socket"
    with pytest.raises(InvalidArgument):
        Client.from_url("grpc+unix://relative/path")


def test_a_copy_made_after_the_read_lease_lapsed_is_discarded_and_refetched(start_server, monkeypatch):
    server = start_server(lease_ttl_s=0.2)
    with Client.from_url(server.url, same_host=True) as client:
        data = os.urandom(MiB)
        client.put(NS, b"k", data)
        real_read = SharedArena.read

        def stalled_read(self, ranges, size, out=None):  # fault injection: the reader stalls past its lease
            real_read(self, ranges, size, out)
            wait_for(lambda: len(server.leases) == 0, timeout_s=5, what="the read lease to lapse")
            return b"\0" * size  # what a reader of reused pages could have seen
        monkeypatch.setattr(SharedArena, "read", stalled_read)
        assert client.get(NS, b"k") == data  # Release reported the lapse: re-read over gRPC


def test_a_reservation_that_lapsed_cannot_be_committed(start_server, monkeypatch):
    server = start_server(lease_ttl_s=0.2)
    with Client.from_url(server.url, same_host=True) as client:
        real_write = SharedArena.write

        def stalled_write(self, ranges, payload):  # fault injection: the writer stalls past its lease
            real_write(self, ranges, payload)
            wait_for(server.leases.all_quarantined, timeout_s=5, what="the reservation to lapse")
        monkeypatch.setattr(SharedArena, "write", stalled_write)
        data = os.urandom(MiB)
        client.put(NS, b"late", data)  # Commit fails (NOT_FOUND), the client puts it again over gRPC
        monkeypatch.undo()
        assert client.get(NS, b"late") == data


def test_lease_table_quarantines_expired_reservations_and_reports_lapsed_reads():
    from tiercache.server.leases import LeaseTable

    released = []
    table = LeaseTable(ttl_s=60)
    try:
        write = table.grant("w", released.append, writable=True)
        read = table.grant("r", released.append, writable=False)
        now = __import__("time").monotonic() + 61
        table.expire(now)
        assert released == ["r"]  # the read pin is released; the reservation is only quarantined
        with pytest.raises(NotFound):  # the reservation is quarantined: it can no longer be committed
            table.take(write, writable=True)
        assert table.release([read], writable=False) == [read]  # reported as lapsed
        table.expire(now + 61)
        assert released == ["r", "w"]  # ...and its pages are freed one TTL later
    finally:
        table.close()


def test_reads_copied_well_inside_their_leases_release_them_off_the_callers_path(start_server):
    server = start_server(lease_ttl_s=60)
    with Client.from_url(server.url, same_host=True) as client:
        data = os.urandom(2 * MiB)
        client.put(NS, b"k", data)
        for _ in range(5):
            assert client.get(NS, b"k") == data
        # The background path was taken (the copies took far less than 30 s).
        assert client.paths.arena(time.monotonic() + 1).released_in_background > 0
        wait_for(lambda: len(server.leases) == 0, timeout_s=10, what="the background releases")
        assert client.get(NS, b"k") == data
    assert len(server.leases) == 0  # close() sends what was still pending
