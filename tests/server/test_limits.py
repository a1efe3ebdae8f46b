"""Requests in flight per host and per tenant (tiercache.server.limits): counted while held, refused over a limit with
a message that names the setting, given back on every exit, and one count for both transports' peer names."""

from __future__ import annotations

import threading

import pytest

from tiercache.errors import Busy, CapacityExceeded
from tiercache.server.limits import Counts, StreamLimits, peer_host


@pytest.mark.parametrize("peer, host", [
    ("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:5000", "::1"), ("unix:/run/tc.sock", "unix"),
    ("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("unix", "unix"),
])
def test_a_peer_is_its_host_whichever_transport_names_it(peer, host):
    assert peer_host(peer) == host


def test_counts_hold_up_to_the_limit_and_refuse_the_next():
    counts = Counts(2, "things (server.max_things)")
    with counts.hold("a", "host a"), counts.hold("a", "host a"):
        assert counts.held("a") == 2 and counts.snapshot() == {"a": 2}
        with pytest.raises(CapacityExceeded, match=r"host a has 2 things \(server.max_things\)"):
            with counts.hold("a", "host a"):
                pass
        with counts.hold("b", "host b"):  # another name has its own count
            assert counts.snapshot() == {"a": 2, "b": 1}
    assert counts.held("a") == 0 and counts.snapshot() == {}  # names holding none are dropped


def test_counts_give_back_when_the_block_raises_and_a_refusal_takes_nothing():
    counts = Counts(1, "things")
    with pytest.raises(ValueError):
        with counts.hold("a", "a"):
            raise ValueError("the request failed")
    assert counts.held("a") == 0
    with counts.hold("a", "a"):
        with pytest.raises(CapacityExceeded):
            with counts.hold("a", "a"):
                pass
        assert counts.held("a") == 1  # the refused one was never counted


def test_counts_raise_the_refusal_they_are_given():
    counts = Counts(0, "connections", refusal=Busy)
    with pytest.raises(Busy):
        with counts.hold("a", "a"):
            pass


def test_counts_are_exact_under_threads():
    counts = Counts(1000, "things")
    go = threading.Barrier(8)

    def worker() -> None:
        go.wait()
        for _ in range(500):
            with counts.hold("a", "a"):
                pass
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts.snapshot() == {}


def test_stream_limits_count_a_request_against_its_host_and_its_tenant():
    limits = StreamLimits(per_client=2, per_peer=2, per_tenant=3)
    with limits.stream("ipv4:10.0.0.1:1", "t"), limits.stream("10.0.0.1", "t"):  # gRPC and data channel: one host
        assert limits.peers.snapshot() == {"10.0.0.1": 2} and limits.tenants.snapshot() == {"t": 2}
        with pytest.raises(CapacityExceeded, match="server.max_streams_per_peer"):
            with limits.stream("ipv4:10.0.0.1:2", "u"):
                pass
        assert limits.tenants.snapshot() == {"t": 2}  # the host's refusal took no tenant slot
        with limits.stream("10.0.0.2", "t"):
            with pytest.raises(CapacityExceeded, match="tenant 't' has 3 requests in flight"):
                with limits.stream("10.0.0.3", "t"):
                    pass
            assert limits.peers.snapshot() == {"10.0.0.1": 2, "10.0.0.2": 1}  # nor did the tenant's keep a host's
    assert limits.peers.snapshot() == {} and limits.tenants.snapshot() == {}


def test_a_client_at_its_limit_leaves_its_hosts_other_clients_served():
    """Engines of one node share its address: one holding its limit locks out none of the others."""
    limits = StreamLimits(per_client=2, per_peer=4, per_tenant=10)
    with limits.stream("ipv4:10.0.0.1:1", "t", "stuck"), limits.stream("10.0.0.1", "t", "stuck"):  # both transports
        assert limits.clients.snapshot() == {"10.0.0.1 stuck": 2}
        with pytest.raises(CapacityExceeded, match="client 'stuck' of 10.0.0.1 has 2 requests in flight "
                                                   r"\(server.max_streams_per_client\)"):
            with limits.stream("ipv4:10.0.0.1:1", "t", "stuck"):
                pass
        with limits.stream("ipv4:10.0.0.1:7", "t", "other"), limits.stream("ipv4:10.0.0.1:7", "t", "other"):
            with pytest.raises(CapacityExceeded, match="server.max_streams_per_peer"):  # the host's bound still holds
                with limits.stream("ipv4:10.0.0.1:8", "t", "third"):
                    pass
            assert limits.clients.snapshot() == {"10.0.0.1 stuck": 2, "10.0.0.1 other": 2}  # the refusal took none
    assert limits.clients.snapshot() == limits.peers.snapshot() == {}


def test_a_caller_that_names_no_client_is_counted_by_its_connection():
    limits = StreamLimits(per_client=1, per_peer=5, per_tenant=10)
    with limits.stream("ipv4:10.0.0.1:1", "t"):
        with pytest.raises(CapacityExceeded, match="client 'ipv4:10.0.0.1:1' of 10.0.0.1"):
            with limits.stream("ipv4:10.0.0.1:1", "t"):  # the same gRPC channel
                pass
        with limits.stream("ipv4:10.0.0.1:2", "t"):  # another channel of the same host
            assert limits.peers.snapshot() == {"10.0.0.1": 2}
