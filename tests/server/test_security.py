"""TLS and mutual TLS on the gRPC port, bearer tokens mapped to tenants, namespaces bound to a tenant's salt, quotas,
Redis AUTH with an ACL user and Redis over TLS. Real servers, real certificates (made by tests/certs.py)."""

from __future__ import annotations

import hashlib
import logging

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.certs import make_pki
from testkit.redis_processes import RedisProcess
from tiercache.prefix.delivered import Delivered
from tiercache.client import Client
from tiercache.client.retry import RetryPolicy
from tiercache.config import SecurityConfig
from tiercache.errors import CapacityExceeded, ConfigError, PermissionDenied, TierCacheError, Unauthenticated
from tiercache.record.keys import salt_suffix
from tiercache.server.auth import TenantTable

TOKEN_A, TOKEN_B, TOKEN_OPS = "token-of-team-a-0123456789", "token-of-team-b-0123456789", "token-of-ops-0123456789"
SALT_A, SALT_B = "salt-a-9f8e7d", "salt-b-1a2b3c"
NS_A, NS_B = "model@main#fp" + salt_suffix(SALT_A), "model@main#fp" + salt_suffix(SALT_B)


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path)


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  team-a:
    token: {TOKEN_A}
    salt: {SALT_A}
    quota_bytes: 1MiB
  team-b:
    token_sha256: {hashlib.sha256(TOKEN_B.encode()).hexdigest()}
    salt: {SALT_B}
    same_host: true
  ops:
    token: {TOKEN_OPS}
    admin: true
""")
    return str(path)


def _client(server, **options) -> Client:
    return Client.from_url(server.url, timeout_s=10, retry=RetryPolicy(attempts=1), **options)


# -- TLS ------------------------------------------------------------------------------------------------------------

def test_tls_round_trip_and_plaintext_refused(start_server, pki):
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key))
    assert server.url.startswith("grpcs://")
    with _client(server, tls_ca_file=pki.ca) as client:
        client.put("ns", b"k", b"over tls")
        assert client.get("ns", b"k") == b"over tls"
    plaintext = f"grpc://127.0.0.1:{server.port}"
    with (Client.from_url(plaintext, timeout_s=2, retry=RetryPolicy(attempts=1)) as client,
          pytest.raises(TierCacheError)):
        client.get("ns", b"k")


def test_tls_rejects_a_server_the_client_does_not_trust(start_server, pki, tmp_path):
    other = make_pki(tmp_path, prefix="other-")
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key))
    with _client(server, tls_ca_file=other.ca) as client, pytest.raises(TierCacheError):
        client.get("ns", b"k")


def test_mutual_tls_requires_a_client_certificate_from_the_ca(start_server, pki, tmp_path):
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  tls_client_ca_file=pki.ca))
    with _client(server, tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key) as client:
        client.put("ns", b"k", b"mutual")
        assert client.get("ns", b"k") == b"mutual"
    with _client(server, tls_ca_file=pki.ca) as anonymous, pytest.raises(TierCacheError):
        anonymous.get("ns", b"k")
    stranger = make_pki(tmp_path, prefix="stranger-")
    with _client(server, tls_ca_file=pki.ca, tls_cert_file=stranger.client_cert,
                 tls_key_file=stranger.client_key) as client, pytest.raises(TierCacheError):
        client.get("ns", b"k")


def test_plaintext_health_port_answers_probes_while_grpc_is_tls(start_server, pki):
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  health_port=0))
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service="tiercache.v1.TierCache"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:  # the cache service itself is not on the health port
            channel.unary_unary("/tiercache.v1.TierCache/Stats")(b"", timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_tls_config_needs_both_files():
    with pytest.raises(ConfigError, match="together"):
        SecurityConfig(tls_cert_file="cert.pem")
    with pytest.raises(ConfigError, match="mutual TLS"):
        SecurityConfig(tls_client_ca_file="ca.pem")


# -- tenants ----------------------------------------------------------------------------------------------------------

def test_calls_without_a_known_token_are_unauthenticated(start_server, tenants_file):
    server = start_server(security=SecurityConfig(tenants_file=tenants_file))
    for token in (None, "not-a-token-of-anyone"):
        with _client(server, token=token) as client:
            for call in (lambda c: c.get(NS_A, b"k"), lambda c: c.put(NS_A, b"k", b"x"), lambda c: c.stats()):
                with pytest.raises(Unauthenticated):
                    call(client)


def test_a_tenant_touches_only_namespaces_with_its_salt(start_server, tenants_file):
    server = start_server(security=SecurityConfig(tenants_file=tenants_file), shared_memory=False)
    with _client(server, token=TOKEN_A) as a, _client(server, token=TOKEN_B) as b:
        a.put(NS_A, b"k", b"team a's prompt")
        b.put(NS_B, b"k", b"team b's prompt")
        # B knows A's namespace string (it is no secret), but its token does not own it: reading, probing,
        # deleting and overwriting are all refused, and A's bytes are untouched.
        for call in (lambda: b.get(NS_A, b"k"), lambda: b.exists(NS_A, [b"k"]), lambda: b.delete(NS_A, [b"k"]),
                     lambda: b.put(NS_A, b"k", b"forged"), lambda: b.report_delivery(NS_A, Delivered(1, {"host": 5})),
                     lambda: b.put("model@main#fp", b"k", b"unsalted")):
            with pytest.raises(PermissionDenied):
                call()
        assert a.get(NS_A, b"k") == b"team a's prompt"
        assert [n["namespace"] for n in a.stats()["namespaces"]] == [NS_A]
    with _client(server, token=TOKEN_OPS) as ops:
        assert ops.get(NS_B, b"k") == b"team b's prompt"
        assert {n["namespace"] for n in ops.stats()["namespaces"]} == {NS_A, NS_B}


def test_same_host_path_only_for_tenants_allowed_it(start_server, tenants_file):
    server = start_server(security=SecurityConfig(tenants_file=tenants_file))
    with _client(server, token=TOKEN_A) as a, _client(server, token=TOKEN_B) as b:
        assert not a.same_host and b.same_host  # A falls back to streaming: its calls still work
        a.put(NS_A, b"k", b"streamed")
        b.put(NS_B, b"k", b"in place")
        assert (a.get(NS_A, b"k"), b.get(NS_B, b"k")) == (b"streamed", b"in place")
    with _client(server, token=TOKEN_A, same_host=True) as forced, pytest.raises(TierCacheError):
        forced.put(NS_A, b"k2", b"x")


def test_quota_refuses_puts_past_the_tenant_bytes(start_server, tenants_file):
    server = start_server(security=SecurityConfig(tenants_file=tenants_file), shared_memory=False)
    with _client(server, token=TOKEN_A) as a, _client(server, token=TOKEN_B) as b:
        for i in range(3):
            a.put(NS_A, b"k%d" % i, bytes(300_000))
        with pytest.raises(CapacityExceeded, match="quota"):
            a.put(NS_A, b"k3", bytes(300_000))
        b.put(NS_B, b"big", bytes(2_000_000))  # team b has no quota; team a's does not touch it
        assert a.get(NS_A, b"k3") is None and a.get(NS_A, b"k0") == bytes(300_000)
        a.delete(NS_A, [b"k0", b"k1"])  # room again
        a.put(NS_A, b"k3", bytes(300_000))


@pytest.mark.parametrize("text, message", [
    ("tenants: {}", "non-empty"),
    ("tenants: {a: {token: short, salt: s}}", "at least 16"),
    ("tenants: {a: {token_sha256: abc, salt: s}}", "64 hex"),
    ("tenants: {a: {token: 0123456789abcdef0}}", "salt is required"),
    ("tenants: {a: {token: 0123456789abcdef0, salt: s, colour: red}}", "unknown key colour"),
    ("tenants: {a: {token: 0123456789abcdef0, salt: s}, b: {token: 0123456789abcdef0, salt: t}}", "share a token"),
    ("tenants: [unclosed", "not valid YAML"),
    ("tenants: {a: {token: 0123456789abcdef0, salt: s, quota_bytes: 20 gigs}}",
     r"^tenants file .*tenants\.yaml: tenant 'a': quota_bytes: not a size: '20 gigs'"),
])
def test_bad_tenants_files_are_refused_without_echoing_tokens(tmp_path, text, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as raised:
        TenantTable.load(str(path))
    assert "0123456789abcdef0" not in str(raised.value)


def test_secrets_stay_out_of_logs_and_stats(start_server, tenants_file, redis_proc, tmp_path, caplog):
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret-redis-password\n")
    redis_proc.client().execute_command("ACL", "SETUSER", "cache", "on", ">s3cret-redis-password", "~tiercache:*",
                                        "+@all")
    caplog.set_level(logging.DEBUG)
    server = start_server(security=SecurityConfig(tenants_file=tenants_file), redis_url=redis_proc.url,
                          redis_options=dict(username="cache", password_file=str(password_file)))
    with _client(server, token=TOKEN_OPS) as ops:
        ops.put(NS_A, b"k", b"x")
        stats = str(ops.stats())
    with _client(server, token="wrong-token-wrong-token") as stranger, pytest.raises(Unauthenticated):
        stranger.stats()
    shown = stats + caplog.text + repr(server.config) + repr(server.tenants.tenants)
    for secret in (TOKEN_A, TOKEN_B, TOKEN_OPS, SALT_A, SALT_B, "s3cret-redis-password", "wrong-token"):
        assert secret not in shown


# -- Redis AUTH and TLS -------------------------------------------------------------------------------------------

def test_redis_acl_user_with_password_from_a_file(start_server, redis_proc, tmp_path):
    admin = redis_proc.client()
    admin.execute_command("ACL", "SETUSER", "cache", "on", ">pw-from-file", "~tiercache:*", "+@all")
    password_file = tmp_path / "redis-password"
    password_file.write_text("pw-from-file\n")
    server = start_server(host_bytes=0, disk_bytes=0, redis_url=redis_proc.url,
                          redis_options=dict(username="cache", password_file=str(password_file)))
    with _client(server) as client:
        assert client.put("ns", b"k", b"via acl user") == "redis"
        assert client.get("ns", b"k") == b"via acl user"
    assert any(k.startswith(b"tiercache:") for k in admin.keys())
    # The same user may not touch keys outside its pattern: the ACL really applies to what tiercache sends.
    user = redis.Redis(port=redis_proc.port, username="cache", password="pw-from-file")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere", b"x")


def test_redis_wrong_password_is_a_down_tier_not_a_crash(start_server, redis_proc, tmp_path):
    redis_proc.client().execute_command("ACL", "SETUSER", "cache", "on", ">right", "~*", "+@all")
    password_file = tmp_path / "redis-password"
    password_file.write_text("wrong")
    server = start_server(redis_url=redis_proc.url, redis_options=dict(username="cache",
                                                                       password_file=str(password_file)))
    with _client(server) as client:
        assert client.put("ns", b"k", b"local") == "host"  # the local tiers keep serving
        assert client.get("ns", b"k") == b"local"
    redis_tier = next(t for t in server.store.stats().tiers if t.name == "redis")
    assert not redis_tier.up


def test_redis_over_tls(start_server, pki):
    tls_port = RedisProcess().port  # a free port for the TLS listener
    node = RedisProcess("--tls-port", str(tls_port), "--tls-cert-file", pki.server_cert, "--tls-key-file",
                        pki.server_key, "--tls-ca-cert-file", pki.ca, "--tls-auth-clients", "optional").start()
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        server = start_server(host_bytes=0, disk_bytes=0, redis_url=url, redis_options=dict(tls_ca_file=pki.ca))
        with _client(server) as client:
            assert client.put("ns", b"k", b"over rediss") == "redis"
            assert client.get("ns", b"k") == b"over rediss"
        assert len(node.client().keys("tiercache:*")) == 1
    finally:
        node.stop()


def test_nothing_deserializes_client_data_with_pickle_or_eval():
    """Requests are protobuf and raw bytes; a pickle or eval anywhere in the package would be a remote-code hole."""
    import ast
    from pathlib import Path

    import tiercache

    offenders = []
    for path in Path(tiercache.__file__).parent.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names = [node.func.id]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names
                          if n in ("pickle", "cPickle", "dill", "marshal", "eval", "exec", "shelve")]
    assert offenders == []
