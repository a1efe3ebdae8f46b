"""Recurrent states live under their own byte budget per tier and are evicted by value, KV by recency."""

from __future__ import annotations

import os

import pytest

from tests.tiers.placing import NoRoom, put
from tiercache.config import Config, DiskTierConfig, HostTierConfig, KiB, MiB
from tiercache.record import encoding
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.host import host_tier

SIZE = 100 * KiB


def make(kind, tmp_path, capacity=2 * MiB, budget=500 * KiB, weight=0.5):
    if kind == "host":
        return host_tier(HostTierConfig(capacity_bytes=capacity, state_budget_bytes=budget, state_value_weight=weight))
    return DiskTier(DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=capacity, state_budget_bytes=budget,
                                   state_value_weight=weight))


def state(name: str, prefix_tokens: int) -> tuple[ChunkKey, bytearray]:
    key = ChunkKey("ns", name.encode())
    return key, encoding.encode(key, os.urandom(SIZE), ChunkMeta(CLASS_STATE, prefix_tokens))


def kv(name: str) -> tuple[ChunkKey, bytearray]:
    key = ChunkKey("ns", name.encode())
    return key, encoding.encode(key, os.urandom(SIZE), ChunkMeta(CLASS_KV, 544))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_budget_is_never_exceeded(kind, tmp_path):
    tier = make(kind, tmp_path)
    for i in range(30):
        put(tier, *state(f"s{i}", 1000 + i))
        usage = tier.usage()
        assert usage.state_bytes <= usage.state_budget_bytes == 500 * KiB
    assert tier.usage().state_chunks == 4  # 4 records of 100 KiB + header fit in 500 KiB
    tier.check()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_shallow_old_state_goes_before_deep_recent_one(kind, tmp_path):
    tier = make(kind, tmp_path)
    for name, tokens in (("deep", 200_000), ("shallow", 544), ("mid", 50_000), ("newer", 100_000)):
        put(tier, *state(name, tokens))
    tier.get(ChunkKey("ns", b"deep"))  # oldest by insertion, but just used
    evicted = put(tier, *state("incoming", 120_000), read_victims=True)
    assert [e.key.key for e in evicted] == [b"shallow"]
    assert bytes(encoding.decode(evicted[0].record, evicted[0].key)) is not None


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_pure_recency_when_value_weight_is_zero(kind, tmp_path):
    tier = make(kind, tmp_path, weight=0.0)
    for name, tokens in (("old-deep", 200_000), ("b", 10), ("c", 10), ("d", 10)):
        put(tier, *state(name, tokens))
    evicted = put(tier, *state("e", 10), read_victims=True)
    assert [e.key.key for e in evicted] == [b"old-deep"]


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_states_do_not_push_out_kv_while_under_budget(kind, tmp_path):
    tier = make(kind, tmp_path, capacity=1 * MiB, budget=300 * KiB)
    for i in range(6):
        put(tier, *kv(f"kv{i}"))
    for i in range(5):
        put(tier, *state(f"s{i}", 1000 * i))
    usage = tier.usage()
    assert usage.state_chunks == 2 and usage.chunks - usage.state_chunks == 6


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_state_larger_than_the_budget_is_refused_by_the_tier(kind, tmp_path):

    tier = make(kind, tmp_path, budget=50 * KiB)
    with pytest.raises(NoRoom):
        put(tier, *state("big", 10))


def test_state_budget_survives_a_restart_of_the_disk_tier(tmp_path):
    tier = make("disk", tmp_path)
    put(tier, *state("s", 777))
    put(tier, *kv("k"))
    tier.close()  # a restart: the directory's lock goes with the old tier
    again = make("disk", tmp_path)
    usage = again.usage()
    assert usage.state_chunks == 1 and usage.chunks == 2 and usage.state_bytes > SIZE
    again.check()


def test_store_demotes_states_evicted_by_the_host_budget(tmp_path):
    store = TieredStore.from_config(Config(
        host=HostTierConfig(capacity_bytes=4 * MiB, state_budget_bytes=250 * KiB),
        disk=DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=8 * MiB)))
    for i in range(5):
        key, record = state(f"s{i}", 1000 * (i + 1))
        store.put_record(key, record)
    stats = {t.name: t for t in store.stats().tiers}
    assert stats["host"].state_chunks == 2 and stats["disk"].state_chunks == 3
    assert stats["host"].state_bytes <= 250 * KiB
    assert store.get(ChunkKey("ns", b"s0")).tier == "disk"
