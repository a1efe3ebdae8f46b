"""The eviction policy of tiercache.tiers.index inside real tiers, a store and a real server under pressure: chains
shrink from their deep end across tiers, what a lost object leaves unreachable goes first, recent prompts still hit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.conftest import make_config
from tests.tiers.placing import put
from tiercache.client import Client
from tiercache.config import DiskTierConfig, HostTierConfig, KiB, MiB
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import gated_deltanet_layout
from tiercache.record import encoding
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.server.app import CacheServer
from tiercache.store.tiered import TieredStore
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.host import host_tier



def key(name: str) -> ChunkKey:
    return ChunkKey("ns", name.encode())


def record(name: str, meta: ChunkMeta, size: int = 10 * KiB) -> tuple[ChunkKey, bytearray]:
    k = key(name)
    return k, encoding.encode(k, bytes(size), meta)


def make_tier(kind: str, tmp_path, capacity: int):
    if kind == "host":
        return host_tier(HostTierConfig(capacity_bytes=capacity, page_bytes=4 * KiB))
    return DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=capacity))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tiers_evict_chains_from_the_deep_end_and_keep_the_parent_in_the_record(kind, tmp_path):
    tier = make_tier(kind, tmp_path, 64 * KiB if kind == "host" else 5 * 10_300)  # room for five records
    parent = b""
    for i in range(4):
        put(tier, *record(f"c{i}", ChunkMeta(CLASS_KV, 16, parent)))
        parent = f"c{i}".encode()
    assert put(tier, *record("other", ChunkMeta()), read_victims=True) == []
    evicted = put(tier, *record("other2", ChunkMeta()), read_victims=True)
    assert [e.key.key for e in evicted] == [b"c3"]  # the deep end, though c0 is the oldest
    assert encoding.read_header(evicted[0].record).meta.parent == b"c2"
    assert [k.key for k, _ in tier.children(key("c0"))] == [b"c1"]
    tier.check()


def test_disk_tier_rebuilds_its_chains_after_a_restart(tmp_path):
    tier = make_tier("disk", tmp_path, 1 * MiB)
    put(tier, *record("a", ChunkMeta()))
    put(tier, *record("b", ChunkMeta(CLASS_KV, 16, b"a")))
    put(tier, *record("c", ChunkMeta(CLASS_STATE, 99, b"a")))
    tier.close()  # a restart: the directory's lock goes with the old tier
    again = make_tier("disk", tmp_path, 1 * MiB)
    assert sorted(k.key for k, _ in again.children(key("a"))) == [b"b", b"c"]
    assert dict((k.key, m.prefix_tokens) for k, m in again.children(key("a")))[b"c"] == 99
    again.check()


def test_the_store_frees_what_a_lost_object_leaves_unreachable(tmp_path):
    """The disk tier (last) drops chunk 1 of a chain; the chain's deeper objects in the host tier are then worth
    nothing and are the first to go there, before anything that is still reachable."""
    host = host_tier(HostTierConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB))
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=1 * MiB))
    store = TieredStore([host, disk])
    store.put_record(*record("c1", ChunkMeta()))
    store.put_record(*record("c2", ChunkMeta(CLASS_KV, 16, b"c1")))
    store.put_record(*record("c3", ChunkMeta(CLASS_KV, 16, b"c2")))
    store.put_record(*record("recent", ChunkMeta()))
    put(disk, *host_record(host, "c1"))
    host.delete([key("c1")])  # c1 now lives on disk only
    store.delete([key("c1")])
    for name in ("new1", "new2", "new3", "new4"):  # five records fit: new3 and new4 need room
        store.put_record(*record(name, ChunkMeta()))
    assert host.contains([key("c2"), key("c3"), key("recent")]) == [False, False, True]
    assert disk.contains([key("c2"), key("c3")]) == [False, False]  # unreachable: dropped, not demoted
    host.check()
    disk.check()


def host_record(host, name: str):
    k = key(name)
    return k, host.get(k)


LAYOUT = gated_deltanet_layout("tiny/hybrid", layers=4, full_attention_interval=2, kv_heads=1, head_dim=8,
                               key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4)


@pytest.fixture
def small_server(tmp_path):
    config = make_config(tmp_path, host_bytes=4 * MiB, disk_bytes=0)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, page_bytes=4 * KiB))
    server = CacheServer(config).start()
    with Client.from_url(server.url) as client:
        yield server, client
    server.stop(grace_s=0)


def test_under_pressure_what_survives_is_reachable_and_recent_prompts_still_hit(small_server):
    """A hybrid workload ten times the host tier through a real server: every object left can still be part of a
    hit (its chain is complete), and the most recent documents hit all but their last token."""
    server, client = small_server
    cache = PrefixCache(client, CacheSpec.for_layout(LAYOUT, match_unit=8))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 30_000, int(rng.integers(200, 600))) for _ in range(60)]
    for prompt in prompts:
        lookup = cache.lookup(prompt)
        plan = cache.plan_prompt(lookup)
        cache.save({ref: bytes(cache.spec.object_bytes(ref)) for ref in plan.objects})
    stats = client.stats()
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert host["evictions"] > 0
    store_tiers = server.store.tiers
    held = store_tiers[0]._index.items()  # noqa: SLF001 - the invariant is about the index itself
    keys = {k for k, _ in held}
    roots = {cache.spec.hashes(p).at(0) for p in prompts}
    for k, entry in held:
        parent = entry.meta.parent
        assert parent[:16] in roots or ChunkKey(k.namespace, parent) in keys, "an unreachable object kept its room"
    for prompt in prompts[-3:]:
        assert cache.lookup(prompt).hit.tokens == len(prompt) - 1


@pytest.mark.parametrize("touched", [True, False])
def test_a_hit_touched_by_its_lookup_survives_the_load_that_promotes_its_chain(tmp_path, touched):
    """Loading a hit from disk promotes its kv chunks to the host tier, whose demotions make the disk tier evict.
    The Lookup touches the hit's checkpoints (store.touch), so the oldest leaves on disk that go are not the hit's
    own state and, behind it, the deep end of its chain; without the touch they are (which is why the Lookup does
    it)."""
    host = host_tier(HostTierConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB))  # five records
    items = [("c1", ChunkMeta()), ("c2", ChunkMeta(CLASS_KV, 16, b"c1")), ("c3", ChunkMeta(CLASS_KV, 16, b"c2")),
             ("s", ChunkMeta(CLASS_STATE, 48, b"c3")), ("x1", ChunkMeta()), ("x2", ChunkMeta()), ("x3", ChunkMeta())]
    records = [record(name, meta) for name, meta in items]
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=sum(len(r) for _, r in records)))
    for k, r in records:
        put(disk, k, r)
    store = TieredStore([host, disk])
    for i in range(5):
        store.put_record(*record(f"h{i}", ChunkMeta()))
    if touched:
        store.touch([key("s")])
    loaded = [store.get(key(name)) is not None for name in ("c1", "c2", "c3", "s")]
    assert all(loaded) == touched, loaded
    host.check()
    disk.check()


def test_a_chain_left_unread_on_disk_outlives_what_is_saved_above_it(tmp_path):
    """c1 -> c2 sit on disk, unread (a lookup found them, but no state to resume from: nothing was loaded); the request
    then saves a state under each and the next chunk c3, in the host tier, above their parents. The disk tier must not
    drop c2 and c1 (leaves down there, and its oldest) while those are held: that loses the chain from its head, and
    with it everything just saved."""
    host = host_tier(HostTierConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB))  # five records
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=6 * len(record("a0", ChunkMeta())[1])))
    store = TieredStore([host, disk])
    store.put_record(*record("c1", ChunkMeta()))
    store.put_record(*record("c2", ChunkMeta(CLASS_KV, 16, b"c1")))
    for i in range(6):
        store.put_record(*record(f"a{i}", ChunkMeta()))
    assert store.locate([key("c1"), key("c2")]) == ["disk", "disk"]
    store.put_record(*record("s1", ChunkMeta(CLASS_STATE, 16, b"c1")))
    store.put_record(*record("s2", ChunkMeta(CLASS_STATE, 32, b"c2")))
    store.put_record(*record("c3", ChunkMeta(CLASS_KV, 16, b"c2")))
    for i in range(4):
        store.put_record(*record(f"b{i}", ChunkMeta()))
    c1, c2, c3 = store.locate([key("c1"), key("c2"), key("c3")])
    assert c1 is not None and (c2 is not None or c3 is None)  # the chain shrinks from its deep end
    host.check()
    disk.check()


def test_an_object_saved_after_its_parent_was_lost_is_unreachable_from_the_start(tmp_path):
    """A save can race the eviction of the chain it extends (a lookup found c1; the save's own demotions drop it
    before c2 arrives). c2 is then unreachable, like the children held when c1 went, and goes first."""
    host = host_tier(HostTierConfig(capacity_bytes=64 * KiB, page_bytes=4 * KiB))  # five records
    disk = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=1 * MiB))
    store = TieredStore([host, disk])
    store.put_record(*record("c1", ChunkMeta()))
    for i in range(3):
        store.put_record(*record(f"x{i}", ChunkMeta()))
    store.delete([key("c1")])
    store.put_record(*record("c2", ChunkMeta(CLASS_KV, 16, b"c1")))
    store.put_record(*record("y0", ChunkMeta()))
    store.put_record(*record("y1", ChunkMeta()))  # the host is full: its first victim is c2, dropped, not demoted
    assert store.locate([key("c2"), key("x0")]) == [None, "host"]
    host.check()
    disk.check()
