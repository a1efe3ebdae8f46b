"""TieredStore policy: placement, LRU demotion, promotion, caps, restarts, corruption, Redis outages."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tiercache.config import Config, DiskTierConfig, HostTierConfig, KiB, MiB, RedisTierConfig
from tiercache.errors import CapacityExceeded
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore

CHUNK = 256 * KiB - 200  # header and all, one record fills 4 pages of 64 KiB


def key(i: int, ns: str = "ns") -> ChunkKey:
    return ChunkKey(ns, b"chunk-%04d" % i)


def payload(i: int, size: int = CHUNK) -> bytes:
    return random.Random(i).randbytes(size)


def make_store(tmp_path: Path, host=1 * MiB, disk=2 * MiB, redis_url=None, write_through=False) -> TieredStore:
    return TieredStore.from_config(Config(
        host=HostTierConfig(capacity_bytes=host),
        disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=disk),
        redis=RedisTierConfig(url=redis_url, write_through=write_through, max_backoff_s=0.2)))


def where(store: TieredStore, n: int) -> list[str | None]:
    return store.locate([key(i) for i in range(n)])


def check(store: TieredStore) -> None:
    for tier in store.tiers:
        if hasattr(tier, "check"):
            tier.check()


def test_puts_demote_in_lru_order(tmp_path):
    store = make_store(tmp_path)  # host holds 4 chunks, disk 8
    for i in range(14):
        store.put(key(i), payload(i))
    assert where(store, 14) == [None] * 2 + ["disk"] * 8 + ["host"] * 4
    check(store)


def test_reads_refresh_recency(tmp_path):
    store = make_store(tmp_path)
    for i in range(4):
        store.put(key(i), payload(i))
    store.get(key(0))
    store.put(key(4), payload(4))  # evicts 1, not 0
    assert where(store, 5) == ["host", "disk", "host", "host", "host"]


def test_disk_hit_is_promoted_and_leaves_disk(tmp_path):
    store = make_store(tmp_path)
    for i in range(6):
        store.put(key(i), payload(i))
    found = store.get(key(0))
    assert found.tier == "disk" and bytes(found.payload) == payload(0)
    assert store.locate([key(0)]) == ["host"]
    assert store.tiers[1].contains([key(0)]) == [False]
    stats = {t.name: t for t in store.stats().tiers}
    assert stats["disk"].promotions == 1 and stats["disk"].hits == 1 and stats["host"].misses == 1
    check(store)


def test_no_tier_ever_exceeds_its_capacity(tmp_path):
    store = make_store(tmp_path, host=2 * MiB, disk=3 * MiB)
    rng = random.Random(1)
    for step in range(300):
        i = rng.randrange(60)
        if rng.random() < 0.5:
            store.put(key(i), payload(i, rng.randrange(1, 400 * KiB)))
        else:
            found = store.get(key(i))
            assert found is None or bytes(found.payload) == payload(i, len(found.payload))
        for tier in store.stats().tiers:
            assert tier.used_bytes <= tier.capacity_bytes
    check(store)


def test_chunk_larger_than_every_tier_is_refused(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(CapacityExceeded):
        store.put(key(0), payload(0, 3 * MiB))


def test_large_chunk_skips_a_small_tier(tmp_path):
    store = make_store(tmp_path, host=1 * MiB, disk=4 * MiB)
    assert store.put(key(0), payload(0, 2 * MiB)) == "disk"


def test_replacing_a_key_drops_the_copy_below(tmp_path):
    store = make_store(tmp_path)
    for i in range(5):
        store.put(key(i), payload(i))  # 0 is on disk
    store.put(key(0), b"new bytes")
    assert store.tiers[1].contains([key(0)]) == [False]
    assert bytes(store.get(key(0)).payload) == b"new bytes"


def test_namespace_accounting(tmp_path):
    store = make_store(tmp_path)
    store.put(key(0, "a"), b"x" * 1000)
    store.put(key(1, "b"), b"y" * 2000)
    by_ns = {n.namespace: n for n in store.stats().namespaces}
    assert by_ns["a"].chunks == 1 and by_ns["b"].chunks == 1
    assert by_ns["b"].used_bytes - by_ns["a"].used_bytes == 1000


def test_delete_reaches_every_tier(tmp_path, redis_url):
    store = make_store(tmp_path, redis_url=redis_url, write_through=True)
    for i in range(6):
        store.put(key(i), payload(i))
    assert store.delete([key(0), key(5), key(99)]) == 2
    assert [t.contains([key(0), key(5)]) for t in store.tiers] == [[False, False]] * 3


def test_disk_tier_survives_restart(tmp_path):
    store = make_store(tmp_path, host=0, disk=4 * MiB)
    for i in range(10):
        store.put(key(i), payload(i))
    store.close()
    disk = tmp_path / "disk"
    (disk / "ab").mkdir(exist_ok=True)
    (disk / "ab" / "leftover.chunk.tmp").write_bytes(b"half a write")
    store = make_store(tmp_path, host=0, disk=4 * MiB)
    assert [bytes(store.get(key(i)).payload) == payload(i) for i in range(10)] == [True] * 10
    assert not (disk / "ab" / "leftover.chunk.tmp").exists()
    check(store)


def test_tokens_and_engine_hashes_survive_a_disk_tier_restart(tmp_path):
    """The KV events a restarted server publishes need the tokens its records carry, headers longer than
    the disk tier's first read of a file included (4,096 tokens: 16 KiB of header)."""
    parent = ChunkKey(key(0).namespace, b"\x07" * 18)
    metas = {i: ChunkMeta(0, 16, parent.key, tokens=bytes(4 * 4096) + bytes((i,)) * 4, engine_hash=i + 1)
             for i in range(3)}
    store = make_store(tmp_path, host=0, disk=4 * MiB)
    for i, meta in metas.items():
        store.put(key(i), payload(i), meta)
    store.close()
    store = make_store(tmp_path, host=0, disk=4 * MiB)
    assert sorted(store.children(parent), key=lambda c: c[1].engine_hash) == [(key(i), metas[i]) for i in range(3)]
    check(store)


def test_restart_with_smaller_cap_evicts_oldest(tmp_path):
    store = make_store(tmp_path, host=0, disk=4 * MiB)
    for i in range(12):
        store.put(key(i), payload(i))
    store.close()
    store = make_store(tmp_path, host=0, disk=1 * MiB)
    assert where(store, 12) == [None] * 8 + ["disk"] * 4
    check(store)


def _files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "disk").glob("*/*.chunk"))


def test_corrupt_disk_file_is_a_miss_and_is_deleted(tmp_path):
    store = make_store(tmp_path, host=0)
    store.put(key(0), payload(0))
    path = _files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    assert store.get(key(0)) is None
    assert not path.exists()
    assert {t.name: t for t in store.stats().tiers}["disk"].checksum_failures == 1


def test_truncated_disk_file_is_dropped_at_start(tmp_path):
    store = make_store(tmp_path, host=0)
    store.put(key(0), payload(0))
    store.close()
    path = _files(tmp_path)[0]
    path.write_bytes(path.read_bytes()[:-10])
    store = make_store(tmp_path, host=0)
    assert store.get(key(0)) is None and not path.exists()


def test_corrupt_redis_value_is_a_miss_and_is_deleted(tmp_path, shared_redis, redis_url):
    store = make_store(tmp_path, host=0, disk=0, redis_url=redis_url)
    store.put(key(0), payload(0))
    r = shared_redis.client()
    (name,) = r.keys("tiercache:*")
    value = bytearray(r.get(name))
    value[-1] ^= 0x01
    r.set(name, bytes(value))
    assert store.get(key(0)) is None
    assert r.exists(name) == 0
    assert store.stats().tiers[0].checksum_failures == 1


def test_redis_hit_is_copied_up_and_stays_shared(tmp_path, redis_url):
    store = make_store(tmp_path, redis_url=redis_url, write_through=True)
    store.put(key(0), payload(0))
    other = make_store(tmp_path / "other", redis_url=redis_url)  # a second node on the same Redis
    found = other.get(key(0))
    assert found.tier == "redis" and bytes(found.payload) == payload(0)
    assert other.locate([key(0)]) == ["host"]
    assert other.tiers[2].contains([key(0)]) == [True]


def test_a_batch_read_from_redis_is_one_round_trip(tmp_path, shared_redis, redis_url):
    writer = make_store(tmp_path, redis_url=redis_url, write_through=True)
    for i in range(5):
        writer.put(key(i), payload(i, 1000))
    reader = make_store(tmp_path / "other", redis_url=redis_url)  # a second node: all five are in Redis only
    r = shared_redis.client()
    r.config_resetstat()
    found = reader.get_many([key(i) for i in range(6)])
    assert [f and (f.tier, bytes(f.payload)) for f in found] == [("redis", payload(i, 1000)) for i in range(5)] + [None]
    calls = {name: stats["calls"] for name, stats in r.info("commandstats").items()}
    assert calls.get("cmdstat_mget") == 1 and "cmdstat_get" not in calls


def test_demotion_reaches_redis_without_write_through(tmp_path, redis_url):
    store = make_store(tmp_path, host=1 * MiB, disk=1 * MiB, redis_url=redis_url)
    for i in range(10):
        store.put(key(i), payload(i))
    assert where(store, 10) == ["redis"] * 2 + ["disk"] * 4 + ["host"] * 4
    assert bytes(store.get(key(0)).payload) == payload(0)


def test_a_chunk_moving_from_disk_to_redis_is_found_at_every_moment(tmp_path, redis_url, monkeypatch):
    """The host arena's gap (`test_a_stored_chunk_is_served_by_every_path_while_stalled_puts_take_the_arena` in
    tests/server/test_data_channel.py) one tier down: a disk victim used to leave the disk's index before the store
    had written it to Redis, so a read in between missed it everywhere. Here every read made while Redis receives a
    victim must find the victim's bytes."""
    store = make_store(tmp_path, host=1 * MiB, disk=1 * MiB, redis_url=redis_url)
    seen = read_while_moving_down(store, 2, monkeypatch)
    for i in range(10):
        store.put(key(i), payload(i))
    assert [k for k, _, _ in seen] == [key(0), key(1)]
    assert all(tier == "disk" and readable for _, tier, readable in seen), seen
    assert where(store, 10) == ["redis"] * 2 + ["disk"] * 4 + ["host"] * 4
    assert bytes(store.get(key(0)).payload) == payload(0)


def test_a_chunk_moving_from_the_arena_to_disk_is_found_at_every_moment(tmp_path, monkeypatch):
    """The same one tier up: while the disk writes a host victim, the host still serves it, whole."""
    store = make_store(tmp_path, host=1 * MiB, disk=2 * MiB)
    seen = read_while_moving_down(store, 1, monkeypatch)
    for i in range(6):
        store.put(key(i), payload(i))
    assert [k for k, _, _ in seen] == [key(0), key(1)]
    assert all(tier == "host" and readable for _, tier, readable in seen), seen
    assert bytes(store.get(key(0)).payload) == payload(0)


def read_while_moving_down(store: TieredStore, level: int, monkeypatch) -> list:
    """Patch tier `level`'s put to read the record it receives in the tier above and in the store, right then:
    (key, the tier the store finds it in, whether the tier above read it)."""
    tier, above = store.tiers[level], store.tiers[level - 1]
    put = tier.put
    seen = []

    def put_and_read_meanwhile(room, record):
        found = store.locate([room.key])[0], above.get(room.key)
        seen.append((room.key, found[0], found[1] is not None))
        return put(room, record)
    monkeypatch.setattr(tier, "put", put_and_read_meanwhile)
    return seen


def test_redis_outage_is_invisible_for_local_chunks(tmp_path, redis_proc):
    store = make_store(tmp_path, redis_url=redis_proc.url, write_through=True)
    for i in range(6):
        store.put(key(i), payload(i))
    redis_proc.kill()
    for i in range(6, 10):
        store.put(key(i), payload(i))  # write-through fails quietly
    assert [bytes(store.get(key(i)).payload) == payload(i) for i in range(4, 10)] == [True] * 6
    redis_tier = store.stats().tiers[2]
    assert not redis_tier.up and redis_tier.errors > 0
    redis_proc.start()  # same port
    wait_for(lambda: store.stats().tiers[2].up, timeout_s=5, what="redis tier to come back")
    store.put(key(20), payload(20))
    assert redis_proc.client().dbsize() == 1
