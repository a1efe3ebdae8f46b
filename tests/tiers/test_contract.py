"""The tier contract (tiercache/tiers/base.py), run against every tier, and every tier checked against the protocols
it claims (and none it does not)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiercache.config import DiskTierConfig, HostTierConfig, KiB, MiB, RedisTierConfig
from tiercache.errors import TierFull
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.host import host_tier
from tiercache.tiers.base import ChainDirectory, HandsDown, MappableArena, Tier
from tiercache.tiers.redis import RedisTier

ALL_TIERS = ["host", "disk", "redis", pytest.param("gpu", marks=pytest.mark.gpu)]
BOUNDED_TIERS = ["host", "disk", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture
def make_tier(tmp_path, request):
    made = []

    def make(kind: str, capacity_bytes: int = 64 * MiB):
        if kind == "host":
            tier = host_tier(HostTierConfig(capacity_bytes=capacity_bytes, page_bytes=64 * KiB))
        elif kind == "gpu":
            torch = pytest.importorskip("torch")
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")
            from tiercache.config import GpuTierConfig
            from tiercache.tiers.gpu import gpu_tier

            tier = gpu_tier(GpuTierConfig(capacity_bytes=capacity_bytes, page_bytes=64 * KiB))
        elif kind == "disk":
            tier = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=capacity_bytes))
        else:
            tier = RedisTier(RedisTierConfig(url=request.getfixturevalue("redis_url")))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        if hasattr(tier, "check"):
            tier.check()
        tier.close()


# What each tier is: the contract's protocols it implements, and so what the store may ask of it.
CLAIMS = {"host": {Tier, ChainDirectory, HandsDown, MappableArena}, "disk": {Tier, ChainDirectory, HandsDown},
          "redis": {Tier}, "gpu": {Tier, ChainDirectory, HandsDown}}
PROTOCOLS = (Tier, ChainDirectory, HandsDown, MappableArena)


def key(i: int, namespace: str = "ns") -> ChunkKey:
    return ChunkKey(namespace, b"key-%d" % i)


def record(i: int, size: int = 10 * KiB, namespace: str = "ns") -> bytearray:
    return encoding.encode(key(i, namespace), os.urandom(size))


@pytest.mark.parametrize("kind", ALL_TIERS)
class TestEveryTier:
    def test_implements_the_protocols_it_claims_and_no_other(self, make_tier, kind):
        tier = make_tier(kind)
        assert {p for p in PROTOCOLS if isinstance(tier, p)} == CLAIMS[kind]

    def test_get_many_answers_in_order_as_get_does(self, make_tier, kind):
        tier = make_tier(kind)
        recs = {i: record(i) for i in (1, 3)}
        for i, rec in recs.items():
            tier.put(key(i), rec, return_evicted=False)
        got = tier.get_many([key(3), key(2), key(1)])
        assert [None if g is None else bytes(g) for g in got] == [bytes(recs[3]), None, bytes(recs[1])]
        assert tier.get_many([]) == []

    def test_put_then_get_returns_identical_bytes(self, make_tier, kind):
        tier = make_tier(kind)
        rec = record(1, 300 * KiB + 7)
        assert tier.put(key(1), rec, return_evicted=True) == []
        assert bytes(tier.get(key(1))) == bytes(rec)

    def test_missing_key_is_none(self, make_tier, kind):
        assert make_tier(kind).get(key(404)) is None

    def test_put_replaces(self, make_tier, kind):
        tier = make_tier(kind)
        tier.put(key(1), record(1), return_evicted=False)
        newer = record(1, 20 * KiB)
        tier.put(key(1), newer, return_evicted=False)
        assert bytes(tier.get(key(1))) == bytes(newer)
        assert tier.usage().chunks == 1

    def test_contains_is_batched_and_ordered(self, make_tier, kind):
        tier = make_tier(kind)
        tier.put(key(2), record(2), return_evicted=False)
        assert tier.contains([key(1), key(2), key(3)]) == [False, True, False]
        assert tier.contains([]) == []

    def test_delete_counts_and_is_idempotent(self, make_tier, kind):
        tier = make_tier(kind)
        for i in range(3):
            tier.put(key(i), record(i), return_evicted=False)
        assert tier.delete([key(0), key(1), key(9)]) == 2
        assert tier.delete([key(0)]) == 0
        assert tier.contains([key(0), key(1), key(2)]) == [False, False, True]

    def test_namespaces_are_separate(self, make_tier, kind):
        tier = make_tier(kind)
        tier.put(key(1, "a"), record(1, namespace="a"), return_evicted=False)
        assert tier.get(key(1, "b")) is None
        assert tier.contains([key(1, "a"), key(1, "b")]) == [True, False]

    def test_usage_counts_chunks(self, make_tier, kind):
        tier = make_tier(kind)
        for i in range(5):
            tier.put(key(i), record(i), return_evicted=False)
        usage = tier.usage()
        assert usage.up and usage.chunks == 5 and usage.used_bytes > 0

    def test_concurrent_puts_and_gets_never_mix_bytes(self, make_tier, kind):
        tier = make_tier(kind, capacity_bytes=4 * MiB)  # small: evictions race with reads
        errors = []

        def worker(base: int) -> None:
            for n in range(40):
                i = base * 1000 + n % 10
                rec = record(i, 64 * KiB)
                tier.put(key(i), rec, return_evicted=True)
                got = tier.get(key(i))
                if got is not None:
                    try:
                        encoding.decode(got, key(i))
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)

        with ThreadPoolExecutor(max_workers=6) as pool:
            workers = [pool.submit(worker, b) for b in range(6)]
        for w in workers:
            w.result()  # an exception in a put or get of a worker thread fails the test
        assert errors == []


@pytest.mark.parametrize("kind", BOUNDED_TIERS)
class TestBoundedTiers:
    def test_eviction_is_lru_and_returns_bytes(self, make_tier, kind):
        tier = make_tier(kind, capacity_bytes=1 * MiB)
        records = {i: record(i, 250 * KiB) for i in range(5)}  # 4 fit in either tier
        for i in range(4):
            assert tier.put(key(i), records[i], return_evicted=True) == []
        tier.get(key(0))  # 0 is now most recent: 1 must go first
        evicted = tier.put(key(4), records[4], return_evicted=True)
        assert [e.key for e in evicted] == [key(1)]
        assert bytes(evicted[0].record) == bytes(records[1])
        assert tier.contains([key(i) for i in range(5)]) == [True, False, True, True, True]

    def test_evicted_without_bytes_when_not_asked(self, make_tier, kind):
        tier = make_tier(kind, capacity_bytes=1 * MiB)
        for i in range(8):
            evicted = tier.put(key(i), record(i, 200 * KiB), return_evicted=False)
            assert all(e.record is None for e in evicted)

    def test_never_over_capacity(self, make_tier, kind):
        cap = 2 * MiB
        tier = make_tier(kind, capacity_bytes=cap)
        for i in range(50):
            tier.put(key(i), record(i, (i * 37 % 300 + 1) * KiB), return_evicted=False)
            assert tier.usage().used_bytes <= cap
        tier.check()

    def test_record_larger_than_tier_is_refused(self, make_tier, kind):
        tier = make_tier(kind, capacity_bytes=1 * MiB)
        tier.put(key(0), record(0), return_evicted=False)
        with pytest.raises(TierFull):
            tier.put(key(1), record(1, 2 * MiB), return_evicted=True)
        assert tier.contains([key(0)]) == [True]  # nothing was evicted for a record that cannot fit

    def test_namespace_accounting_is_exact(self, make_tier, kind):
        tier = make_tier(kind)
        a, b = record(1, 1000, "a"), record(2, 3000, "b")
        tier.put(key(1, "a"), a, return_evicted=False)
        tier.put(key(2, "b"), b, return_evicted=False)
        usage = tier.usage()
        assert usage.bytes_by_namespace == {"a": len(a), "b": len(b)}
        assert usage.used_bytes == len(a) + len(b)
        tier.delete([key(1, "a")])
        assert tier.usage().bytes_by_namespace == {"b": len(b)}

    def test_chains_shrink_from_the_deep_end_and_orphans_go_first(self, make_tier, kind):
        tier = make_tier(kind, capacity_bytes=1 * MiB)

        def linked(i: int, parent: int | None) -> bytearray:
            meta = encoding.ChunkMeta(encoding.CLASS_KV, 16, key(parent).key if parent is not None else b"")
            return encoding.encode(key(i), os.urandom(250 * KiB), meta)

        for i, parent in ((0, None), (1, 0), (2, 1), (3, None)):  # 4 fit; chain 0 -> 1 -> 2, and 3 alone
            tier.put(key(i), linked(i, parent), return_evicted=False)
        assert [k for k, _ in tier.children(key(0))] == [key(1)]
        assert tier.children(key(1))[0][1].parent == key(1).key
        evicted = tier.put(key(4), linked(4, None), return_evicted=True)
        assert [e.key for e in evicted] == [key(2)]  # the chain's deep end, though chunk 0 is the oldest
        assert tier.orphan(key(0)) == 1  # chunk 0 lost elsewhere: chunk 1 is unreachable now
        evicted = tier.put(key(5), linked(5, None), return_evicted=True)
        assert [(e.key, e.reachable) for e in evicted] == [(key(1), False)]


def test_a_host_tier_in_private_memory_is_no_mappable_arena(make_tier, tmp_path):
    tier = host_tier(HostTierConfig(capacity_bytes=1 * MiB, page_bytes=64 * KiB, shared_memory=False))
    try:
        assert isinstance(tier, ChainDirectory) and isinstance(tier, HandsDown)
        assert not isinstance(tier, MappableArena)  # no file to map: the store builds no same-host path over it
    finally:
        tier.close()


def test_a_mappable_arena_names_the_file_clients_map(make_tier):
    tier = make_tier("host")
    assert os.stat(tier.arena.path).st_ino == tier.arena.inode
    assert tier.arena.size_bytes >= tier.capacity_bytes
