"""Connection settings (tiercache.client.settings), the one reader of the client's environment, against a real server
that requires mutual TLS; the error table both wires look codes up in; the one backoff schedule."""

from __future__ import annotations

import itertools

import grpc
import pytest

from tests.certs import make_pki
from tests.helpers import free_port
from tiercache.backoff import Backoff
from tiercache.client import Client, ConnectionSettings, RetryPolicy
from tiercache.config import SecurityConfig
from tiercache.errors import (
    WIRE_CODES,
    Busy,
    CapacityExceeded,
    ConnectFailed,
    ConnectionBroken,
    InvalidArgument,
    TierCacheError,
    TimedOut,
    Unavailable,
)
from tiercache.protocol import data_channel, wire

NS = "model@main#fp"
VARIABLES = ("TIERCACHE_URL", "TIERCACHE_TOKEN", "TIERCACHE_TOKEN_FILE", "TIERCACHE_TLS_CA_FILE",
             "TIERCACHE_TLS_CERT_FILE", "TIERCACHE_TLS_KEY_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_what_is_not_given_comes_from_the_environment(clean_env, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    clean_env.setenv("TIERCACHE_URL", "grpcs://cache.internal:7000")
    clean_env.setenv("TIERCACHE_TOKEN_FILE", str(token_file))
    clean_env.setenv("TIERCACHE_TLS_CA_FILE", "/etc/ca.pem")
    settings = ConnectionSettings.from_env(tls_server_name="cache")
    assert (settings.url, settings.token, settings.tls_ca_file, settings.tls_server_name) == (
        "grpcs://cache.internal:7000", "from-a-file", "/etc/ca.pem", "cache")
    assert (settings.target, settings.uses_tls, settings.host) == ("cache.internal:7000", True, "cache.internal")
    given = ConnectionSettings.from_env(url="grpc+unix:///run/tc.sock", token="given", tls_ca_file="")
    assert (given.url, given.token, given.tls_ca_file) == ("grpc+unix:///run/tc.sock", "given", "/etc/ca.pem")
    assert given.unix_socket and given.target == "unix:/run/tc.sock"
    clean_env.setenv("TIERCACHE_TOKEN", "from-the-variable")  # the variable before the file
    assert ConnectionSettings.from_env().token == "from-the-variable"
    assert "from-the-variable" not in repr(ConnectionSettings.from_env())


def test_nothing_set_means_the_default_url(clean_env):
    assert ConnectionSettings.from_env() == ConnectionSettings(url="grpc://127.0.0.1:50051")


@pytest.mark.parametrize("given, message", [
    ({"url": "http://h:1"}, "expected a URL"),
    ({"url": "grpc+unix://relative"}, "absolute"),
    ({"tls_cert_file": "/c.pem"}, "together"),
    ({"tls_certfile": "/c.pem"}, "unknown connection settings: tls_certfile"),
])
def test_unusable_settings_are_refused_with_the_key(clean_env, given, message):
    with pytest.raises(InvalidArgument, match=message):
        ConnectionSettings.from_env(**given)


def test_a_connectors_config_is_split_into_the_connection_and_the_engines_keys(clean_env):
    clean_env.setenv("TIERCACHE_TOKEN", "t")
    connection, rest = ConnectionSettings.from_config({"url": "grpc://h:1", "salt": "s", "timeout_s": 2})
    assert (connection.url, connection.token, rest) == ("grpc://h:1", "t", {"salt": "s", "timeout_s": 2})


def test_mutual_tls_from_the_environment_alone(start_server, clean_env, tmp_path):
    pki = make_pki(tmp_path)
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  tls_client_ca_file=pki.ca))
    clean_env.setenv("TIERCACHE_URL", server.url)
    clean_env.setenv("TIERCACHE_TLS_CA_FILE", pki.ca)
    clean_env.setenv("TIERCACHE_TLS_CERT_FILE", pki.client_cert)
    clean_env.setenv("TIERCACHE_TLS_KEY_FILE", pki.client_key)
    for same_host in (None, False):  # the arena's control calls, and the data channel's own TLS
        with Client(timeout_s=10, retry=RetryPolicy(attempts=1), same_host=same_host) as client:
            client.put(NS, b"k", b"mutual")
            assert client.get(NS, b"k") == b"mutual"
    clean_env.delenv("TIERCACHE_TLS_CERT_FILE")
    clean_env.delenv("TIERCACHE_TLS_KEY_FILE")
    with Client(timeout_s=5, retry=RetryPolicy(attempts=1)) as anonymous, pytest.raises(ConnectionBroken):
        anonymous.get(NS, b"k")  # no client certificate: no handshake, so the server was never reached


# -- the one error table --------------------------------------------------------------------------------------------

def test_every_error_names_one_status_on_each_wire_and_comes_back_from_it():
    for row in WIRE_CODES:
        error = row.error("x")
        assert wire.status_for(error).name == row.grpc_status and data_channel.code_for(error) == row.data_code
        # A code names the first error listed with it, a base class before its subclasses.
        assert issubclass(row.error, type(wire.error_for(wire.status_for(error), "x")))
        assert issubclass(row.error, type(data_channel.error_for(data_channel.code_for(error), "x")))
    assert type(data_channel.error_for(8, "x")) is Busy
    assert type(wire.error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "x")) is CapacityExceeded
    for local in (ConnectionBroken("x"), ConnectFailed("x")):  # never sent: named as what they are kinds of
        assert wire.status_for(local) == grpc.StatusCode.UNAVAILABLE and data_channel.code_for(local) == 4
    assert wire.status_for(ValueError()) == grpc.StatusCode.INTERNAL
    assert data_channel.code_for(ValueError()) == data_channel.INTERNAL
    assert type(data_channel.error_for(99, "x")) is TierCacheError


def test_a_call_that_reaches_no_server_is_connection_broken_and_a_passed_deadline_timed_out(hung_port):
    for port, kind in ((free_port(), ConnectFailed), (hung_port, TimedOut)):
        with Client.from_url(f"grpc://127.0.0.1:{port}", timeout_s=0.5, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(kind) as failed:
                client.stats()
            assert isinstance(failed.value, ConnectionBroken)  # both retried, both open a breaker


@pytest.mark.parametrize("where", ["port", "unix socket"])
def test_a_server_that_is_not_there_is_connect_failed_in_one_line_naming_its_url(where, tmp_path):
    # Before: gRPC's own text, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to
    # connect to remote host: Connection refused", as a ConnectionBroken that named no URL the caller had given.
    url, reason = ((f"grpc://127.0.0.1:{free_port()}", "Connection refused") if where == "port" else
                   (f"grpc+unix://{tmp_path / 'nobody.sock'}", "No such file or directory"))
    with Client.from_url(url, timeout_s=5) as client:  # the default retries: each try fails the same way
        for call in (lambda: client.put(NS, b"k", b"v"), lambda: client.get(NS, b"k"), client.stats):
            with pytest.raises(ConnectFailed) as failed:
                call()
            assert str(failed.value) == f"cannot connect to the tiercache server at {url}: {reason}"


def test_data_that_is_not_bytes_is_invalid_argument_before_any_call(start_server):
    server = start_server()
    with Client.from_url(server.url, timeout_s=5) as client:
        with pytest.raises(InvalidArgument, match=r"^chunk data must be bytes-like .*got str: encode it first$"):
            client.put(NS, b"k", "v")  # before: memoryview's raw TypeError
        with pytest.raises(InvalidArgument, match=r"^chunk data must be a contiguous bytes-like object .*got int$"):
            client.put_many(NS, [(b"k", 5)])
        with pytest.raises(InvalidArgument, match=r"^a get_many buffer must be .*got str"):
            client.get_many(NS, [b"k"], into=["not a buffer"])
        assert client.locate(NS, [b"k"]) == [None]  # nothing was stored


# -- the one backoff ------------------------------------------------------------------------------------------------

def test_backoff_doubles_up_to_its_cap_and_refuses_a_busy_loop():
    assert list(itertools.islice(Backoff(0.05, 0.3).delays(), 5)) == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert list(RetryPolicy(attempts=3, backoff=Backoff(0.01, 1.0)).delays()) == [0.01, 0.02]
    assert list(RetryPolicy(attempts=1).delays()) == []
    for first_s, max_s in ((0, 1), (1, 0.5)):
        with pytest.raises(InvalidArgument):
            Backoff(first_s, max_s)


def test_busy_is_a_capacity_error_the_client_does_not_retry():
    assert issubclass(Busy, CapacityExceeded) and not issubclass(Busy, Unavailable)
