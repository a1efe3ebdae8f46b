"""The payload paths and their chooser (tiercache.client.chooser) against real servers: which path each call takes,
what falls back to which, and that asking the server's Attach blocks no other call. The server's own RPC metrics
say which path carried a call."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.server.test_data_channel import _wait_served
from tiercache.client import Client, RetryPolicy
from tiercache.client.arena_path import ArenaPath
from tiercache.client.chooser import ARENA_MIN_BYTES
from tiercache.client.data_channel import DataChannelPath
from tiercache.config import MiB
from tiercache.errors import InvalidArgument, TimedOut

NS = "model@main#fp"


@pytest.mark.parametrize("options, size, puts, gets", [
    # On the server's host: in place through its arena, where a call moves ARENA_MIN_BYTES or more...
    ({}, ARENA_MIN_BYTES, ["Reserve", "Commit"], ["Acquire"]),
    # ...and below that over the data channel, whose one round trip costs less (a get without the caller's buffers
    # has no size to go by: the arena)...
    ({}, MiB + 7, ["DataPut"], ["Acquire"]),
    ({"same_host": True}, MiB + 7, ["Reserve", "Commit"], ["Acquire"]),  # ...unless told to use the arena
    ({"same_host": False}, MiB + 7, ["DataPut"], ["DataGet"]),  # elsewhere: the data channel
    ({"same_host": False, "data_channel": False}, MiB + 7, ["Put"], ["Get"]),  # told not to: gRPC streams
])
def test_each_call_takes_the_path_the_chooser_picks(start_server, options, size, puts, gets):
    server = start_server()
    data = os.urandom(size)
    with Client.from_url(server.url, **options) as client:
        assert client.put(NS, b"k", data) == "host"
        assert client.get(NS, b"k") == data
        mapped = isinstance(client.paths.arena(time.monotonic() + 5), ArenaPath)
        assert mapped == (options.get("same_host") is not False)
        assert isinstance(client.paths.data_channel, DataChannelPath) == ("DataPut" in puts or "DataGet" in gets)
    others = {"Reserve", "Commit", "Acquire", "DataPut", "DataGet", "Put", "Get"} - {*puts, *gets}
    _wait_served(server, {**{(m, "OK"): 1 for m in (*puts, *gets)}, **{(m, "OK"): 0 for m in others}})


def test_small_same_host_reads_into_the_callers_buffers_go_over_the_data_channel(start_server):
    server = start_server()
    small, big = os.urandom(1000), os.urandom(ARENA_MIN_BYTES)
    with Client.from_url(server.url) as client:
        client.put_many(NS, [(b"small", small), (b"big", big)])  # together: ARENA_MIN_BYTES and more, the arena
        (got,) = client.get_many(NS, [b"small"], [bytearray(4096)])
        assert got.data == small and got.tier == "host"
        (got,) = client.get_many(NS, [b"big"], [bytearray(ARENA_MIN_BYTES)])
        assert got.data == big
    _wait_served(server, {("Reserve", "OK"): 1, ("Commit", "OK"): 1, ("DataGet", "OK"): 1, ("Acquire", "OK"): 1,
                          ("DataPut", "OK"): 0})


def test_without_a_data_channel_small_same_host_calls_go_through_the_arena(start_server):
    server = start_server(data_channel=False)
    with Client.from_url(server.url) as client:
        assert client.put(NS, b"k", b"small") == "host"
        assert client.get_many(NS, [b"k"], [bytearray(16)])[0].data == b"small"
    _wait_served(server, {("Reserve", "OK"): 1, ("Commit", "OK"): 1, ("Acquire", "OK"): 1, ("DataPut", "OK"): 0,
                          ("DataGet", "OK"): 0})


def test_a_read_the_arena_carries_in_part_comes_back_whole_and_in_order(start_server):
    # A chunk larger than the host arena lands on disk and cannot be leased there: the arena answers it ELSEWHERE
    # and the chooser fetches it over the data channel, into the caller's buffer, in its place in the batch.
    server = start_server(host_bytes=2 * MiB, disk_bytes=32 * MiB)
    small, big = os.urandom(1000), os.urandom(3 * MiB)
    with Client.from_url(server.url, same_host=True) as client:  # the arena, however small the call
        assert client.put_many(NS, [(b"small", small), (b"big", big)]) == ["host", "disk"]
        buffers = [bytearray(3 * MiB) for _ in range(3)]
        got = client.get_many(NS, [b"big", b"missing", b"small"], buffers)
        assert [f and f.tier for f in got] == ["disk", None, "host"]
        assert got[0].data == big and got[0].data.obj is buffers[0]
        assert got[2].data == small and got[2].data.obj is buffers[2]
    # The put: Reserve refused for the batch, which then went by the data channel whole; the get: one Acquire, then
    # one data-channel request for the chunk the arena could not bring.
    _wait_served(server, {("Reserve", "RESOURCE_EXHAUSTED"): 1, ("DataPut", "OK"): 1, ("Acquire", "OK"): 1,
                          ("DataGet", "OK"): 1, ("Get", "OK"): 0})


def test_asking_attach_holds_up_no_other_call(hung_port):
    """The Attach lock used to be held across a retried Attach: of two calls that needed the server's Attach
    answer at once, the second waited out the first's whole call before its own deadline even started (~2 s here).
    Each call now ends by its own deadline."""
    with Client.from_url(f"grpc://127.0.0.1:{hung_port}", timeout_s=1.0, retry=RetryPolicy(attempts=4)) as client:
        waited: dict[str, float] = {}

        def timed(name: str, call) -> None:
            started = time.monotonic()
            with pytest.raises(TimedOut):  # a hung server answers nothing within the deadline
                call()
            waited[name] = time.monotonic() - started
        calls = {"attach": client.server_max_chunk_bytes, "put": lambda: client.put(NS, b"k", b"v")}
        threads = [threading.Thread(target=timed, args=item) for item in calls.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(waited) == ["attach", "put"] and max(waited.values()) < 1.6


def test_a_get_into_a_too_small_buffer_fails_on_every_path(start_server):
    server = start_server()
    for options in ({}, {"same_host": False}, {"same_host": False, "data_channel": False}):
        with Client.from_url(server.url, **options) as client:
            client.put(NS, b"k", bytes(1000))
            with pytest.raises(InvalidArgument, match="cannot hold"):
                client.get(NS, b"k", into=bytearray(10))
            assert client.get(NS, b"k") == bytes(1000)  # the path is still usable
    _wait_served(server, {("Get", "OK"): 2})  # the streams path: the refused read, then the good one
