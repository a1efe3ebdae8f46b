"""The client's circuit breaker against real servers: a dead one (nothing listening), a hung one (a socket that
accepts connections and never answers), and one that comes back on the same port."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import free_port, wait_for
from tiercache.client import Backoff, BreakerPolicy, Client, RetryPolicy
from tiercache.connector import PrefixCache
from tiercache.errors import CircuitOpen, ConnectFailed, Unavailable
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import preset

FAST_PROBES = BreakerPolicy(probe_timeout_s=0.1, probe_backoff=Backoff(first_s=0.01, max_s=0.05))


def _client(port: int, **options) -> Client:
    return Client.from_url(f"grpc://127.0.0.1:{port}", retry=RetryPolicy(attempts=1), breaker=FAST_PROBES,
                           **options)


def test_a_dead_server_opens_the_breaker_and_the_server_coming_back_closes_it(start_server):
    port = free_port()
    with _client(port, timeout_s=2) as client:
        with pytest.raises(ConnectFailed, match=f"^cannot connect to the tiercache server at {client.settings.url}: "):
            client.stats()  # the first call did try the server
        assert client.breaker.is_open
        with pytest.raises(CircuitOpen):
            client.locate("ns", [b"k"])  # not tried while open
        server = start_server(port=port)
        assert server.port == port
        wait_for(lambda: not client.breaker.is_open, timeout_s=10, what="a health check to close the breaker")
        assert client.put("ns", b"k", b"back") == "host"
        assert client.get("ns", b"k") == b"back"
        assert client.breaker.opened == 1


def test_a_hung_server_costs_one_deadline_then_calls_fail_at_once(hung_port):
    with _client(hung_port, timeout_s=0.3) as client:
        with pytest.raises(Unavailable) as first:
            client.stats()  # the deadline passes: DEADLINE_EXCEEDED is TimedOut, an Unavailable
        assert not isinstance(first.value, CircuitOpen)
        wait_for(lambda: client.breaker.probes >= 3, timeout_s=10, what="three health checks")
        assert client.breaker.is_open  # a hung server does not answer a health check either
        for _ in range(5):
            with pytest.raises(CircuitOpen):
                client.stats()
    assert not any(t.name == "tiercache-breaker" and t.is_alive() for t in __import__("threading").enumerate())


def test_prefix_lookups_during_an_outage_are_misses_logged_once(caplog):
    spec = CacheSpec.for_layout(preset("qwen3.5-0.8b"))
    with _client(free_port(), timeout_s=1) as client, caplog.at_level(logging.WARNING):
        cache = PrefixCache(client, spec)
        lookups = [cache.lookup(list(range(1000 + i))) for i in range(5)]
        assert [(lookup.hit.tokens, lookup.reached) for lookup in lookups] == [(0, False)] * 5
        assert cache.load(lookups[0].hit) == {}  # nothing to load for a miss: no call
    failures = [r for r in caplog.records if "treating it as a miss" in r.getMessage()]
    outages = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(failures) == 1 and len(outages) == 1  # one line per outage, not per request


def test_without_a_breaker_every_call_tries_the_server():
    with Client.from_url(f"grpc://127.0.0.1:{free_port()}", timeout_s=1, retry=RetryPolicy(attempts=1)) as client:
        for _ in range(3):
            with pytest.raises(Unavailable) as failed:
                client.stats()
            assert not isinstance(failed.value, CircuitOpen)
        assert client.breaker is None


def test_an_unavailable_answer_from_a_reachable_server_keeps_the_breaker_closed(start_server):
    # The only tier is Redis, and nothing listens where it points: the server answers UNAVAILABLE itself.
    server = start_server(host_bytes=0, disk_bytes=0, redis_url=f"redis://127.0.0.1:{free_port()}")
    with _client(server.port, timeout_s=5, same_host=False) as client:
        with pytest.raises(Unavailable) as answered:
            client.put("ns", b"k", b"nowhere to go")
        assert "down" in str(answered.value) and not isinstance(answered.value, CircuitOpen)
        assert not client.breaker.is_open and client.breaker.opened == 0
        assert client.stats()["tiers"]  # still asked: the server was there all along
