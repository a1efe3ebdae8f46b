"""PrefixCache against a real server: hits from every tier, namespace isolation, lookup reports, corruption."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tiercache.client import Client
from tiercache.connector.prefix_cache import PrefixCache, save_objects
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_ref
from tiercache.prefix.presets import gated_deltanet_layout

LAYOUT = gated_deltanet_layout("tiny/hybrid", layers=4, full_attention_interval=2, kv_heads=1, head_dim=8,
                               key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4)


def spec(**changes) -> CacheSpec:
    layout = changes.pop("layout", LAYOUT)
    return CacheSpec.for_layout(layout, match_unit=changes.pop("match_unit", 8), **changes)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n)


def prefill(cache: PrefixCache, prompt) -> int:
    """What an engine does: look up, load, compute the rest, save what admission plans (payload: object size)."""
    lookup = cache.lookup(prompt)
    assert cache.load(lookup.hit) is not None
    plan = cache.plan_prompt(lookup)
    cache.save({ref: bytes([ref.kind]) * cache.spec.object_bytes(ref) for ref in plan.objects})
    return lookup.hit.tokens


@pytest.fixture
def client(start_server, request):
    options = getattr(request, "param", {})
    server = start_server(**options)
    with Client.from_url(server.url) as c:
        yield c


def test_unified_block_size_of_the_tiny_layout():
    # one GDN layer: conv 16 channels x 3 x bf16 (96 B) + 2 x 4 x 4 fp32 (128 B) = 224 B; KV 32 B/token -> 7 -> 16
    assert spec().chunk_tokens == 16


@pytest.mark.parametrize("client", [{}, {"host_bytes": 0}], indirect=True, ids=["host", "disk"])
def test_repeat_hits_and_loads_identical_bytes(client):
    cache = PrefixCache(client, spec())
    prompt = tokens(100)
    assert prefill(cache, prompt) == 0
    lookup = cache.lookup(prompt)
    assert lookup.hit.tokens == 99
    loaded = cache.load(lookup.hit)
    assert {ref.kind for ref in loaded} == {ObjectKind.KV, ObjectKind.TAIL, ObjectKind.STATE}
    for ref, data in loaded.items():
        assert data == bytes([ref.kind]) * cache.spec.object_bytes(ref)


def test_repeat_hits_from_redis(start_server, redis_url):
    writer = start_server(redis_url=redis_url, write_through=True)
    reader = start_server(redis_url=redis_url)  # another node: empty local tiers
    prompt = tokens(100)
    with Client.from_url(writer.url) as a, Client.from_url(reader.url) as b:
        prefill(PrefixCache(a, spec()), prompt)
        lookup = PrefixCache(b, spec()).lookup(prompt)
    assert lookup.hit.tokens == 99 and {o.tier for o in lookup.hit.objects} == {"redis"}


@pytest.mark.parametrize("other", [
    {"match_unit": 16},
    {"chunk_tokens": 64},
    {"salt": "tenant-b"},
    {"layout": dataclasses.replace(LAYOUT, revision="v2")},
    {"layout": gated_deltanet_layout("tiny/hybrid", layers=4, full_attention_interval=2, kv_heads=1, head_dim=8,
                                     key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4,
                                     kv_dtype="float16")},
    {"layout": dataclasses.replace(LAYOUT, model="tiny/other")},
], ids=["u", "N", "salt", "revision", "dtype", "model"])
def test_namespaces_never_hit_each_other(client, other):
    prompt = tokens(100)
    prefill(PrefixCache(client, spec()), prompt)
    assert PrefixCache(client, spec()).lookup(prompt).hit.tokens == 99
    assert PrefixCache(client, spec(**other)).lookup(prompt).hit.tokens == 0


def test_lookups_and_what_loads_delivered_are_reported_to_the_server(client):
    cache = PrefixCache(client, spec())
    prompt = tokens(70)
    prefill(cache, prompt)
    prefill(cache, prompt)
    stats = client.stats()
    assert stats["lookups"] == {"lookups": 2, "requested_tokens": 140, "found_tokens_by_tier": {"host": 69}}
    # The second prefill loaded the 69 tokens (the first found nothing and loaded nothing).
    assert stats["delivered"] == {"loads": 1, "loaded_tokens_by_tier": {"host": 69}, "failed_loads": 0,
                                  "failed_load_tokens": 0, "saves_dropped_by_reason": {}}


def test_a_load_that_fails_is_reported_as_failed_not_delivered(client):
    cache = PrefixCache(client, spec())
    prompt = tokens(90)
    prefill(cache, prompt)
    lookup = cache.lookup(prompt)
    client.delete(cache.namespace, [o.ref.key for o in lookup.hit.objects])
    assert cache.load(lookup.hit) is None
    delivered = client.stats()["delivered"]
    assert (delivered["loads"], delivered["failed_loads"], delivered["failed_load_tokens"]) == (0, 1, 89)
    assert sum(delivered["loaded_tokens_by_tier"].values()) == 0


def test_corrupt_object_makes_the_load_fail_not_lie(start_server, tmp_path):
    server = start_server(host_bytes=0)
    with Client.from_url(server.url) as client:
        cache = PrefixCache(client, spec())
        prompt = tokens(100)
        prefill(cache, prompt)
        for path in (tmp_path / "disk").glob("*/*.chunk"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(data)
        lookup = cache.lookup(prompt)
        assert lookup.hit.tokens == 99  # presence is cheap and says yes...
        assert cache.load(lookup.hit) is None  # ...but no corrupt byte is ever returned
        assert cache.lookup(prompt).hit.tokens == 0  # and the bad copies are gone


def test_pure_attention_layout_round_trip(client):
    layout = ModelLayout("tiny/attn", (LayerGroup(GroupKind.FULL_ATTENTION, (0, 1), kv_heads=2, head_dim=4),))
    cache = PrefixCache(client, spec(layout=layout))
    prompt = tokens(50)
    prefill(cache, prompt)
    assert cache.lookup(prompt).hit.tokens == 49


def test_object_sizes_follow_the_layout():
    s = spec()
    hashes = s.hashes(tokens(40))
    assert s.object_bytes(object_ref(s, hashes, ObjectKind.KV, 16, 0)) == 16 * 2 * 32  # 2 attention layers
    assert s.object_bytes(object_ref(s, hashes, ObjectKind.TAIL, 37, 0)) == 5 * 2 * 32
    assert s.object_bytes(object_ref(s, hashes, ObjectKind.STATE, 37, 1)) == 2 * 224


def test_a_cache_outage_is_a_miss_never_a_failed_request(start_server, caplog):
    """The server going away mid-traffic: lookups miss, loads recompute, saves are skipped, nothing raises."""
    from tiercache.client.retry import RetryPolicy

    server = start_server()
    with Client.from_url(server.url, timeout_s=1, retry=RetryPolicy(attempts=1)) as client:
        cache = PrefixCache(client, spec())
        prompt = tokens(100)
        assert prefill(cache, prompt) == 0
        hit = cache.lookup(prompt).hit
        assert hit.tokens == 99
        server.stop(grace_s=0)
        assert cache.lookup(prompt).hit.tokens == 0
        assert cache.load(hit) is None
        plan = cache.plan_finish(prompt, 100)
        assert cache.save({ref: bytes(cache.spec.object_bytes(ref)) for ref in plan.objects}).objects == 0
    assert "treating it as a miss" in caplog.text and "skipped" in caplog.text


def test_a_save_past_the_tenant_quota_is_skipped(start_server, tmp_path):
    from tiercache.config import SecurityConfig

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: {a: {token: token-of-tenant-a-0123, salt: salt-a, quota_bytes: 1KiB}}")
    server = start_server(security=SecurityConfig(tenants_file=str(tenants)))
    with Client.from_url(server.url, token="token-of-tenant-a-0123") as client:
        cache = PrefixCache(client, spec(salt="salt-a"))
        lookup = cache.lookup(tokens(100))
        plan = cache.plan_prompt(lookup)
        assert cache.save({ref: bytes(cache.spec.object_bytes(ref)) for ref in plan.objects}).objects == 0


def test_a_tensor_parallel_lookup_hits_only_what_every_rank_holds(client):
    """An engine's ranks save their shards under the scheduler's keys, each in its own rank's namespace (the vLLM
    connector's workers). The scheduler's lookup (all_ranks) must not offer a prefix one rank lacks: that rank's
    load would fail, and fail again for every later request of that prefix."""
    layout = dataclasses.replace(LAYOUT, tp_size=2)
    scheduler = PrefixCache(client, spec(layout=layout), all_ranks=True)
    rank1_namespace = spec(layout=dataclasses.replace(layout, tp_rank=1)).namespace
    prompt = tokens(100, seed=21)

    def run(prompt, ranks) -> None:
        plan = scheduler.plan_prompt(scheduler.lookup(prompt))
        payloads = {ref: bytes([ref.kind]) * scheduler.spec.object_bytes(ref) for ref in plan.objects}
        for namespace in ranks:
            save_objects(client, namespace, payloads)

    run(prompt[:40], [scheduler.namespace, rank1_namespace])  # both ranks: states at 16, 32, 39
    assert scheduler.lookup(prompt[:40]).hit.tokens == 39
    run(prompt, [scheduler.namespace])  # rank 1's save of the 100-token prompt was lost
    assert PrefixCache(client, spec(layout=layout)).lookup(prompt).hit.tokens == 99  # rank 0 alone: all of it
    lookup = scheduler.lookup(prompt)
    # The deepest position both ranks hold: the end of the 40-token prompt (kv chunks 16, 32, tail and state at 39).
    assert lookup.hit.tokens == 39
    assert {o.ref.position for o in lookup.hit.objects} == {16, 32, 39}
    assert client.get_many(rank1_namespace, [o.ref.key for o in lookup.hit.objects]).count(None) == 0
    # Objects only rank 0 holds do not count as present, so a later save plans them again (rank 1 writes its own).
    assert scheduler.plan_prompt(lookup).objects
