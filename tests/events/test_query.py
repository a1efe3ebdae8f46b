"""The pod query (tiercache.events.query) of real server processes, over gRPC (Client.query_pods) and HTTP (Mooncake's
shapes, tiercache.server.query_http): each pod's answer is the Lookup hit of the same prompt for that pod — at a
boundary checkpoint, mid-block through a tail and a state, never past the deepest checkpoint, nothing for a miss, over
every rank namespace — and its tiers after a demotion to disk; by the block hashes the pod's real event stream
published; scoped by tenant; changing no recency and no statistics; bad HTTP input answered 400, the server intact."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest

from testkit.event_subscriber import Subscriber
from testkit.saved_chunks import N, chunks, engine_hash, prompt, spec_of
from tests.events.strict_router import Router
from tests.helpers import ServerProcess, free_port
from tests.prefix.chains import ATTENTION, HYBRID
from tests.server.test_security import SALT_A, TOKEN_A, TOKEN_B, TOKEN_OPS, tenants_file  # noqa: F401 - a fixture
from tiercache.client import Client, ConnectionSettings
from tiercache.config import EventsConfig
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.errors import ConfigError, InvalidArgument, NotFound


@pytest.fixture
def served():
    """served(*flags) -> a running `tiercache serve --events` with the pod query on HTTP (its port: .query_port)."""
    processes = []

    def start(*flags: str) -> ServerProcess:
        port = free_port()
        process = ServerProcess("--events", "--events-query-port", str(port), "--host-mem", "4MiB",
                                "--no-data-channel", *flags).start()
        process.query_port = port
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()


def register(client: Client, spec, pod_id: str = "pod-a", namespaces=None):
    return client.register_pod(pod_id, "tiny", namespaces or [spec.namespace], spec.shape,
                               range(len(spec.shape.kinds)), match_unit=spec.match_unit)


def lookup(client: Client, spec, tokens, ranks: int = 1):
    """The hit the pod's own connector gets from Lookup (not counted: report=False)."""
    return PrefixCache(client, spec_of(spec.layout, 0, ranks), report=False, all_ranks=ranks > 1).lookup(tokens).hit


def post(port: int, path: str, body, token: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_each_pod_restores_what_lookup_finds_for_it(served):
    server = served()
    spec = spec_of(HYBRID)
    at_boundary, mid_block, past_checkpoint, saved_alone = (prompt(seed, 100) for seed in range(4))
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, at_boundary, kv=2, states=[64]))
        client.put_many(spec.namespace, chunks(spec, mid_block, kv=2, states=[75], tails=[75]))  # a ragged link
        client.put_many(spec.namespace, chunks(spec, past_checkpoint, kv=3, states=[32]))
        register(client, spec)
        expected = {"at a boundary": 64, "mid-block": 75, "kv past the checkpoint": 32, "a miss": 0}
        for (case, hit), tokens in zip(expected.items(), (at_boundary, mid_block, past_checkpoint, saved_alone)):
            (answer,) = client.query_pods(tokens, model_name="tiny")
            assert (case, answer.matched_tokens) == (case, hit) == (case, lookup(client, spec, tokens).tokens)
            assert answer.pod_id == "pod-a" and answer.block_tokens == N and answer.tenant == "open"
            assert answer.tokens_by_tier == ({"host": hit} if hit else {})
            status, body = post(server.query_port, "/query", {"model": "tiny", "token_ids": tokens})
            assert status == 200
            assert body == {"open": {"pod-a": {"longest_matched": hit, "GPU": 0, "CPU": hit, "DISK": 0,
                                               "DP": {"0": hit}}}}
        # A prompt that stops inside the hit resumes before its last token, as Lookup says.
        (answer,) = client.query_pods(mid_block[:70])
        assert answer.matched_tokens == lookup(client, spec, mid_block[:70]).tokens
        # Whole blocks of the router's own size only, when it says its block size (Mooncake's rule).
        status, body = post(server.query_port, "/query", {"model": "tiny", "token_ids": mid_block, "block_size": 16})
        assert body["open"]["pod-a"]["longest_matched"] == 64 and body["open"]["pod-a"]["CPU"] == 64
        assert client.query_pods(mid_block, model_name="another") == []
        assert post(server.query_port, "/query", {"model": "another", "token_ids": mid_block}) == (200, {})
        # A prompt under a LoRA adapter or a cache_salt lives in salted namespaces no pod registered.
        assert post(server.query_port, "/query", {"model": "tiny", "token_ids": mid_block, "cache_salt": "s"}) == \
            (200, {})


def test_every_rank_namespace_must_hold_the_hit(served):
    server = served()
    rank0, rank1 = spec_of(HYBRID, 0, 2), spec_of(HYBRID, 1, 2)
    tokens = prompt(5, 100)
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(rank0.namespace, chunks(rank0, tokens, kv=3, states=[64, 96]))
        # Rank 1 saved its shards of the same objects (rank 0's keys), but not the state at 96.
        client.put_many(rank1.namespace, chunks(rank0, tokens, kv=3, states=[64], engine=False))
        register(client, rank0, namespaces=[rank0.namespace, rank1.namespace])
        (answer,) = client.query_pods(tokens)
        assert answer.matched_tokens == 64 == lookup(client, rank0, tokens, ranks=2).tokens


def test_tiers_after_a_demotion_to_disk_and_a_query_changes_no_recency(served):
    server = served("--host-mem", "256KiB", "--disk-size", "1MiB")  # two chunks of 64 KiB in the host tier
    spec = spec_of(ATTENTION)
    first, second, third = (prompt(seed, 40) for seed in (10, 11, 12))
    with Client.from_url(server.url, same_host=False) as client:
        register(client, spec)
        client.put_many(spec.namespace, chunks(spec, first, kv=1, payload_bytes=64 << 10))
        client.put_many(spec.namespace, chunks(spec, second, kv=1, payload_bytes=64 << 10))
        stats = client.stats()["lookups"]
        for _ in range(3):  # queries of the oldest chunk: were they uses, the next put would evict `second`
            (answer,) = client.query_pods(first)
            assert answer.tokens_by_tier == {"host": 32}
            assert post(server.query_port, "/query", {"model": "tiny", "token_ids": first})[0] == 200
        assert client.stats()["lookups"] == stats  # no lookup counted
        client.put_many(spec.namespace, chunks(spec, third, kv=1, payload_bytes=64 << 10))
        (answer,) = client.query_pods(first)
        assert answer.tokens_by_tier == {"disk": 32} == lookup(client, spec, first).tokens_by_tier()
        assert client.query_pods(second)[0].tokens_by_tier == {"host": 32}
        status, body = post(server.query_port, "/query", {"model": "tiny", "token_ids": first})
        assert body["open"]["pod-a"] == {"longest_matched": 32, "GPU": 0, "CPU": 0, "DISK": 32, "DP": {"0": 32}}


def test_a_hybrid_hit_split_between_host_and_disk(served):
    server = served("--host-mem", "256KiB", "--disk-size", "1MiB")
    spec = spec_of(HYBRID)
    tokens = prompt(13, 100)
    with Client.from_url(server.url, same_host=False) as client:
        register(client, spec)
        client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[96], payload_bytes=64 << 10))
        (answer,) = client.query_pods(tokens)
        by_tier = lookup(client, spec, tokens).tokens_by_tier()
        assert answer.matched_tokens == 96 and answer.tokens_by_tier == by_tier and "disk" in by_tier
        status, body = post(server.query_port, "/query", {"model": "tiny", "token_ids": tokens})
        assert body["open"]["pod-a"] == {"longest_matched": 96, "GPU": 0, "CPU": by_tier.get("host", 0),
                                         "DISK": by_tier["disk"], "DP": {"0": 96}}


def test_by_the_block_hashes_the_pods_events_published(served):
    server = served()
    spec = spec_of(HYBRID)
    tokens = prompt(20, 100)
    with Client.from_url(server.url, same_host=False) as client:
        client.put_many(spec.namespace, chunks(spec, tokens, kv=3, states=[64, 96]))
        endpoints = register(client, spec)
        subscriber = Subscriber(endpoints.endpoint, endpoints.replay_endpoint).ready()
        try:
            router = Router()
            for _, _, batch in subscriber.replay(0):
                router.apply(batch[1])
        finally:
            subscriber.close()
        stored = {e.block_hashes[0]: e.parent_block_hash for e in router.held.values() if e.kind == "full_attention"}
        chain, parent = [], None  # the published blocks in prompt order, by their parents
        while (child := next((h for h, p in stored.items() if p == parent), None)) is not None:
            chain.append(child)
            parent = child
        assert chain == [engine_hash(tokens, k * N) for k in (1, 2, 3)]
        for blocks, hit in ((3, 96), (2, 64), (1, 0), (0, 0)):
            (answer,) = client.query_pods(block_hashes=chain[:blocks])
            # The blocks' prompt goes on past them: what Lookup answers for them and one more token.
            assert answer.matched_tokens == hit == lookup(client, spec, tokens[:blocks * N + 1]).tokens
            status, body = post(server.query_port, "/query_by_hash", {"model": "tiny", "block_hash": chain[:blocks],
                                                                      "block_size": N})
            assert status == 200 and body["open"]["pod-a"]["longest_matched"] == hit
        assert client.query_pods(block_hashes=chain[1:])[0].matched_tokens == 0  # not from the prompt's start
        signed = [h - (1 << 64) if h >= 1 << 63 else h for h in chain]  # a router keeping i64 (Dynamo)
        assert post(server.query_port, "/query_by_hash", {"model": "tiny", "seq_hashes": signed})[1] == \
            {"open": {"pod-a": {"longest_matched": 96, "GPU": 0, "CPU": 96, "DISK": 0, "DP": {"0": 96}}}}
        status, body = post(server.query_port, "/query_by_hash", {"model": "tiny", "block_hash": chain,
                                                                  "block_size": 16})
        assert status == 400 and "32 tokens" in body["error"]
        with pytest.raises(InvalidArgument):
            client.query_pods(tokens, block_hashes=chain)


def test_a_tenant_sees_its_own_pods_only(served, tenants_file):  # noqa: F811
    server = served("--tenants-file", tenants_file)
    spec = dataclasses.replace(spec_of(HYBRID), salt=SALT_A)  # team a's namespace
    tokens = prompt(30, 100)
    with Client(ConnectionSettings(url=server.url, token=TOKEN_A)) as a, \
            Client(ConnectionSettings(url=server.url, token=TOKEN_B)) as b, \
            Client(ConnectionSettings(url=server.url, token=TOKEN_OPS)) as ops:
        a.put_many(spec.namespace, chunks(spec, tokens, kv=2, states=[64]))
        register(a, spec)
        assert [(p.pod_id, p.matched_tokens, p.tenant) for p in a.query_pods(tokens)] == [("pod-a", 64, "team-a")]
        assert b.query_pods(tokens) == [] and b.query_pods(tokens, pod_ids=["pod-a"]) == []
        assert [(p.pod_id, p.tenant) for p in ops.query_pods(tokens)] == [("pod-a", "team-a")]
    query = {"model": "tiny", "token_ids": tokens}
    assert post(server.query_port, "/query", query, TOKEN_A)[1] == \
        {"team-a": {"pod-a": {"longest_matched": 64, "GPU": 0, "CPU": 64, "DISK": 0, "DP": {"0": 64}}}}
    assert post(server.query_port, "/query", query, TOKEN_B) == (200, {})
    assert post(server.query_port, "/query", {**query, "tenant_id": "team-a", "instance_id": "pod-a"}, TOKEN_B) == \
        (200, {})
    assert post(server.query_port, "/query", {**query, "tenant_id": "team-b"}, TOKEN_OPS) == (200, {})
    assert list(post(server.query_port, "/query", {**query, "tenant_id": "team-a"}, TOKEN_OPS)[1]) == ["team-a"]
    status, body = post(server.query_port, "/query", query)
    assert status == 401 and "bearer token" in body["error"]
    assert post(server.query_port, "/query", query, "not-a-token-of-anyone")[0] == 401


def test_the_query_needs_events():
    plain = ServerProcess("--host-mem", "1MiB").start()
    try:
        with Client.from_url(plain.url) as client, pytest.raises(NotFound):
            client.query_pods([1, 2, 3])
    finally:
        plain.kill()
    with pytest.raises(ConfigError, match="events.enabled"):
        EventsConfig(query_port=8080)
