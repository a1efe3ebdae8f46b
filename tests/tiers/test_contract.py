"""The tier contract (tiercache/tiers/base.py) as one mixin every tier runs, built the way the server builds it
(`tiers.from_config`): behaviour, not only `isinstance` — rooms, victims readable while they move down, eviction
order, caps, concurrency — and each tier checked against the protocols it claims (and none it does not).

A new tier adds a class here: its configuration and its claims (docs/architecture.md, "A tier")."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.tiers.placing import NoRoom, put
from tiercache import tiers
from tiercache.config import Config, DiskTierConfig, GpuTierConfig, HostTierConfig, KiB, MiB, RedisTierConfig
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import ChainDirectory, MappableArena, Tier

PROTOCOLS = (Tier, ChainDirectory, MappableArena)


def key(i: int, namespace: str = "ns") -> ChunkKey:
    return ChunkKey(namespace, b"key-%d" % i)


def record(i: int, size: int = 10 * KiB, namespace: str = "ns") -> bytearray:
    return encoding.encode(key(i, namespace), os.urandom(size))


def linked(i: int, parent: int | None, size: int = 250 * KiB) -> bytearray:
    meta = encoding.ChunkMeta(encoding.CLASS_KV, 16, key(parent).key if parent is not None else b"")
    return encoding.encode(key(i), os.urandom(size), meta)


class TierContract:
    """What every tier answers. A subclass says how its tier is configured and which protocols it claims."""

    claims: set = {Tier}

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        raise NotImplementedError

    @pytest.fixture
    def make_tier(self, request, tmp_path):
        made = []

        def make(capacity_bytes: int = 64 * MiB) -> Tier:
            (tier,) = tiers.from_config(self.config(request, tmp_path, capacity_bytes))
            made.append(tier)
            return tier

        yield make
        for tier in made:
            if hasattr(tier, "check"):
                tier.check()
            tier.close()

    def test_implements_the_protocols_it_claims_and_no_other(self, make_tier):
        tier = make_tier()
        assert {p for p in PROTOCOLS if isinstance(tier, p)} == self.claims

    def test_put_into_a_room_then_get_returns_identical_bytes(self, make_tier):
        tier = make_tier()
        rec = record(1, 300 * KiB + 7)
        room = tier.make_room(key(1), encoding.read_meta(rec), len(rec), read_victims=True)
        assert room.ready and room.evicted == []
        tier.put(room, rec)
        assert not room.ready  # used up
        assert bytes(tier.get(key(1))) == bytes(rec)

    def test_a_room_given_back_unused_leaves_nothing_behind(self, make_tier):
        tier = make_tier()
        before = tier.usage()
        room = tier.make_room(key(1), encoding.ChunkMeta(), 100 * KiB, read_victims=False)
        tier.release(room)
        tier.release(room)  # idempotent
        assert tier.contains([key(1)]) == [False] and tier.usage().chunks == before.chunks

    def test_get_many_answers_in_order_as_get_does(self, make_tier):
        tier = make_tier()
        recs = {i: record(i) for i in (1, 3)}
        for i, rec in recs.items():
            put(tier, key(i), rec)
        got = tier.get_many([key(3), key(2), key(1)])
        assert [None if g is None else bytes(g) for g in got] == [bytes(recs[3]), None, bytes(recs[1])]
        assert tier.get_many([]) == []

    def test_missing_key_is_none(self, make_tier):
        assert make_tier().get(key(404)) is None

    def test_put_replaces(self, make_tier):
        tier = make_tier()
        put(tier, key(1), record(1))
        newer = record(1, 20 * KiB)
        put(tier, key(1), newer)
        assert bytes(tier.get(key(1))) == bytes(newer)
        assert tier.usage().chunks == 1

    def test_contains_is_batched_and_ordered(self, make_tier):
        tier = make_tier()
        put(tier, key(2), record(2))
        assert tier.contains([key(1), key(2), key(3)]) == [False, True, False]
        assert tier.contains([]) == []

    def test_delete_counts_and_is_idempotent(self, make_tier):
        tier = make_tier()
        for i in range(3):
            put(tier, key(i), record(i))
        assert tier.delete([key(0), key(1), key(9)]) == 2
        assert tier.delete([key(0)]) == 0
        assert tier.contains([key(0), key(1), key(2)]) == [False, False, True]

    def test_namespaces_are_separate(self, make_tier):
        tier = make_tier()
        put(tier, key(1, "a"), record(1, namespace="a"))
        assert tier.get(key(1, "b")) is None
        assert tier.contains([key(1, "a"), key(1, "b")]) == [True, False]

    def test_usage_counts_chunks(self, make_tier):
        tier = make_tier()
        for i in range(5):
            put(tier, key(i), record(i))
        usage = tier.usage()
        assert usage.up and usage.chunks == 5 and usage.used_bytes > 0

    def test_concurrent_puts_and_gets_never_mix_bytes(self, make_tier):
        tier = make_tier(4 * MiB)  # small: evictions race with reads
        errors = []

        def worker(base: int) -> None:
            for n in range(40):
                i = base * 1000 + n % 10
                put(tier, key(i), record(i, 64 * KiB), read_victims=True)
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


class BoundedTierContract(TierContract):
    """What a tier that keeps its own capacity and index (GPU, host, disk) answers besides."""

    def test_a_victim_moving_down_is_readable_until_its_room_is_released(self, make_tier):
        """The invariant the store's eviction loop rests on (tiercache.store.tiered.TieredStore.make_room): between
        the tier taking a victim out and the store releasing the room, the victim is still read here, whole."""
        tier = make_tier(1 * MiB)
        records = {i: record(i, 250 * KiB) for i in range(5)}  # 4 fit
        for i in range(4):
            put(tier, key(i), records[i])
        room = tier.make_room(key(4), encoding.read_meta(records[4]), len(records[4]), read_victims=True)
        assert not room.ready and [e.key for e in room.evicted] == [key(0)]
        assert tier.contains([key(0)]) == [True]
        assert bytes(tier.get(key(0))) == bytes(records[0]) == bytes(room.evicted[0].record)
        assert tier.usage().chunks == 3  # out of the index already: no second eviction picks it
        tier.release(room)
        assert tier.contains([key(0)]) == [False] and tier.get(key(0)) is None
        again = tier.make_room(key(4), encoding.read_meta(records[4]), len(records[4]), read_victims=True)
        assert again.ready
        tier.put(again, records[4])
        assert tier.contains([key(i) for i in range(5)]) == [False, True, True, True, True]

    def test_rooms_given_back_are_reused(self, make_tier):
        tier = make_tier(1 * MiB)
        records = {i: record(i, 250 * KiB) for i in range(4)}  # 4 fit
        for _ in range(3):  # a claim that leaked would leave no room for the fourth, and nothing to evict for it
            for i, rec in records.items():
                room = tier.make_room(key(i), encoding.read_meta(rec), len(rec), read_victims=False)
                assert room.ready
                tier.release(room)
        for i, rec in records.items():
            assert put(tier, key(i), rec) == []
        assert tier.usage().used_bytes == sum(len(r) for r in records.values())

    def test_eviction_is_lru_and_hands_over_the_bytes(self, make_tier):
        tier = make_tier(1 * MiB)
        records = {i: record(i, 250 * KiB) for i in range(5)}  # 4 fit in either tier
        for i in range(4):
            assert put(tier, key(i), records[i], read_victims=True) == []
        tier.get(key(0))  # 0 is now most recent: 1 must go first
        evicted = put(tier, key(4), records[4], read_victims=True)
        assert [e.key for e in evicted] == [key(1)]
        assert bytes(evicted[0].record) == bytes(records[1])
        assert tier.contains([key(i) for i in range(5)]) == [True, False, True, True, True]

    def test_victims_without_bytes_when_not_asked(self, make_tier):
        tier = make_tier(1 * MiB)
        for i in range(8):
            evicted = put(tier, key(i), record(i, 200 * KiB), read_victims=False)
            assert all(e.record is None for e in evicted)

    def test_never_over_capacity(self, make_tier):
        cap = 2 * MiB
        tier = make_tier(cap)
        for i in range(50):
            put(tier, key(i), record(i, (i * 37 % 300 + 1) * KiB))
            assert tier.usage().used_bytes <= cap
        tier.check()

    def test_record_larger_than_tier_is_refused(self, make_tier):
        tier = make_tier(1 * MiB)
        put(tier, key(0), record(0))
        with pytest.raises(NoRoom, match="exceed"):
            put(tier, key(1), record(1, 2 * MiB), read_victims=True)
        assert tier.contains([key(0)]) == [True]  # nothing was evicted for a record that cannot fit

    def test_namespace_accounting_is_exact(self, make_tier):
        tier = make_tier()
        a, b = record(1, 1000, "a"), record(2, 3000, "b")
        put(tier, key(1, "a"), a)
        put(tier, key(2, "b"), b)
        usage = tier.usage()
        assert usage.bytes_by_namespace == {"a": len(a), "b": len(b)}
        assert usage.used_bytes == len(a) + len(b)
        tier.delete([key(1, "a")])
        assert tier.usage().bytes_by_namespace == {"b": len(b)}

    def test_chains_shrink_from_the_deep_end_and_orphans_go_first(self, make_tier):
        tier = make_tier(1 * MiB)
        for i, parent in ((0, None), (1, 0), (2, 1), (3, None)):  # 4 fit; chain 0 -> 1 -> 2, and 3 alone
            put(tier, key(i), linked(i, parent))
        assert [k for k, _ in tier.children(key(0))] == [key(1)]
        assert tier.children(key(1))[0][1].parent == key(1).key
        evicted = put(tier, key(4), linked(4, None), read_victims=True)
        assert [e.key for e in evicted] == [key(2)]  # the chain's deep end, though chunk 0 is the oldest
        assert tier.orphan(key(0)) == 1  # chunk 0 lost elsewhere: chunk 1 is unreachable now
        evicted = put(tier, key(5), linked(5, None), read_victims=True)
        assert [(e.key, e.reachable, e.record) for e in evicted] == [(key(1), False, None)]  # nothing to move down

    def test_the_parent_of_the_record_is_never_its_victim(self, make_tier):
        tier = make_tier(1 * MiB)
        put(tier, key(0), linked(0, None, 900 * KiB))
        with pytest.raises(NoRoom, match="no room"):  # only the parent could go: the deeper record is refused
            put(tier, key(1), linked(1, 0, 200 * KiB))
        assert tier.contains([key(0), key(1)]) == [True, False]


class TestHostTier(BoundedTierContract):
    claims = {Tier, ChainDirectory, MappableArena}

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        return only(host=HostTierConfig(capacity_bytes=capacity_bytes, page_bytes=64 * KiB))

    def test_a_mappable_arena_names_the_file_clients_map(self, make_tier):
        tier = make_tier()
        assert os.stat(tier.arena.path).st_ino == tier.arena.inode
        assert tier.arena.size_bytes >= tier.capacity_bytes

    def test_a_reservation_is_invisible_until_committed_and_abort_gives_its_room_back(self, make_tier):
        tier = make_tier(1 * MiB)
        rec = record(1, 300 * KiB)
        meta = encoding.read_meta(rec)
        reservation = tier.reserve(tier.make_room(key(1), meta, len(rec), read_victims=False))
        assert tier.contains([key(1)]) == [False]
        tier.abort(reservation)
        assert tier.usage().used_bytes == 0
        reservation = tier.reserve(tier.make_room(key(1), meta, len(rec), read_victims=False))
        start = encoding.header_bytes(key(1), meta)
        payload = memoryview(rec)[start:]
        at = 0
        for view in tier.views(reservation.payload_ranges):
            view[:] = payload[at:at + len(view)]
            at += len(view)
        tier.commit(reservation)
        assert bytes(encoding.decode(tier.get(key(1)), key(1), verify=False)) == bytes(payload)  # memory: unsealed


class TestHostTierInPrivateMemory(BoundedTierContract):
    claims = {Tier, ChainDirectory}  # no file to map: the store builds no same-host path over it

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        return only(host=HostTierConfig(capacity_bytes=capacity_bytes, page_bytes=64 * KiB, shared_memory=False))


class TestDiskTier(BoundedTierContract):
    claims = {Tier, ChainDirectory}

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        return only(disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=capacity_bytes))


class TestRedisTier(TierContract):
    claims = {Tier}

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        return only(redis=RedisTierConfig(url=request.getfixturevalue("redis_url")))


@pytest.mark.gpu
class TestGpuTier(BoundedTierContract):
    claims = {Tier, ChainDirectory}

    def config(self, request, tmp_path, capacity_bytes: int) -> Config:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return only(gpu=GpuTierConfig(capacity_bytes=capacity_bytes, page_bytes=64 * KiB))


def only(**sections) -> Config:
    """A configuration that enables the named tier and no other."""
    off = {"host": HostTierConfig(capacity_bytes=0), "disk": DiskTierConfig(capacity_bytes=0),
           "redis": RedisTierConfig(), "gpu": GpuTierConfig()}
    return Config(**{**off, **sections})
