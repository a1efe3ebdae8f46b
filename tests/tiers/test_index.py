"""The one eviction policy (tiercache.tiers.index): chain-aware, unreachable objects first, states by a value score no
outlier distorts. The same policy inside real tiers, a store and a server under pressure: tests/store/test_chains.py."""

from __future__ import annotations

import random
from dataclasses import dataclass


from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.tiers.index import ChunkIndex


@dataclass
class Entry:
    record_bytes: int
    meta: ChunkMeta
    pins: int = 0


def key(name: str) -> ChunkKey:
    return ChunkKey("ns", name.encode())


def kv(parent: str = "", size: int = 100) -> Entry:
    return Entry(size, ChunkMeta(CLASS_KV, 16, parent.encode()))


def state(tokens: int, parent: str = "", size: int = 1000) -> Entry:
    return Entry(size, ChunkMeta(CLASS_STATE, tokens, parent.encode()))


def evict_all(index: ChunkIndex) -> list[str]:
    order = [v.key.key.decode() for v in index.victims(10**12, 0)]
    index.check()
    return order


def chain(index: ChunkIndex, *names: str, parent: str = "") -> None:
    for name in names:
        index.add(key(name), kv(parent))
        parent = name


def test_a_chain_shrinks_from_its_deep_end():
    index = ChunkIndex()
    chain(index, "c1", "c2", "c3")
    index.add(key("x"), kv())
    index.touch(key("c1"))  # the oldest read most recently: still outlives the chunks that extend it
    assert evict_all(index) == ["c3", "c2", "x", "c1"]


def test_a_parent_with_many_children_goes_after_all_of_them():
    index = ChunkIndex()
    index.add(key("system"), kv())
    for i in range(5):
        chain(index, f"a{i}", f"b{i}", parent="system")
    order = evict_all(index)
    assert order[-1] == "system"
    assert all(order.index(f"b{i}") < order.index(f"a{i}") for i in range(5))


def test_unreachable_objects_go_first():
    index = ChunkIndex()
    chain(index, "old1", "old2")
    chain(index, "a2", "a3", "a4", parent="a1")  # a1 itself lives in another tier
    index.add(key("s"), state(5000, parent="a3"))
    assert index.orphan(key("a1")) == 4  # a1 lost for good: everything below it
    victims = index.victims(250, 0)
    assert [v.key.key for v in victims] == [b"a2", b"a3", b"a4"]  # oldest first, regardless of recency
    assert not any(v.reachable for v in victims)
    assert [v.key.key for v in index.victims(1, 1)] == [b"s"]  # the orphan state before any other state
    index.check()


def test_a_lost_parent_stored_again_makes_its_children_reachable_again():
    index = ChunkIndex()
    chain(index, "b", "c", parent="a")
    index.orphan(key("a"))
    index.add(key("a"), kv())
    index.check()
    assert evict_all(index) == ["c", "b", "a"]


def test_children_stored_before_their_parent_keep_it():
    index = ChunkIndex()
    index.add(key("child"), kv("parent"))  # demoted before its parent, say
    index.add(key("parent"), kv())
    index.add(key("other"), kv())
    assert evict_all(index) == ["child", "parent", "other"]


def test_a_full_tier_takes_the_least_recent_leaf_and_a_full_state_budget_a_state():
    index = ChunkIndex()
    index.add(key("s"), state(1000))
    index.add(key("k"), kv())
    assert [v.key.key for v in index.victims(1, 0)] == [b"s"]  # recency, whatever the class
    index.add(key("s2"), state(1000))
    assert [v.key.key for v in index.victims(1, 1)] == [b"s2"]  # the state budget: a state, though k is older
    index.check()


def test_one_deep_state_does_not_flatten_the_value_of_chat_states():
    """Scores are not normalised by the best state, so a 256K-token state leaves the comparison between a small
    recent chat state and a larger older one to their own values (scoring against the best state made recency
    decide it alone), and it outlives unread chat states only until the inflation passes its value."""
    index = ChunkIndex(state_value_weight=0.5)
    index.add(key("deep"), state(262_144))
    index.add(key("big-old"), state(30_000))
    index.add(key("small-new"), state(3_000))
    assert [v.key.key for v in index.victims(0, 1)] == [b"small-new"]
    survived = 0
    for i in range(200):  # a budget of three states, one chat state arriving at a time
        index.add(key(f"chat{i}"), state(3_000))
        gone = [v.key.key for v in index.victims(0, 1)]
        if b"deep" in gone:
            break
        survived += 1
    assert 10 < survived < 200  # valued well above a chat state, but not forever without a read
    index.check()


def test_reads_keep_a_state():
    index = ChunkIndex(state_value_weight=0.5)
    for name in ("a", "b", "c"):
        index.add(key(name), state(3_000))
    index.touch(key("a"))
    assert [v.key.key for v in index.victims(0, 2000)] == [b"b", b"c"]


def test_pure_recency_at_weight_zero():
    index = ChunkIndex(state_value_weight=0.0)
    for name, tokens in (("deep", 200_000), ("b", 10), ("c", 10)):
        index.add(key(name), state(tokens))
    index.touch(key("b"))
    assert [v.key.key for v in index.victims(0, 3000)] == [b"deep", b"c", b"b"]


def test_entries_being_read_stay_in_place():
    index = ChunkIndex()
    index.add(key("pinned"), Entry(100, ChunkMeta(), pins=1))
    index.add(key("free"), kv())
    victims = index.victims(10**6, 0, evictable=lambda e: e.pins == 0)
    assert [v.key.key for v in victims] == [b"free"]
    index.check()
    index.touch(key("pinned"))
    index.check()


def test_random_operations_keep_the_index_consistent():
    """Random adds (chains, states, opaque chunks), reads, removals, losses and evictions; check() after each."""
    rng = random.Random(7)
    index = ChunkIndex()
    names: list[str] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not names:
            name = f"n{step}"
            parent = rng.choice(names) if names and rng.random() < 0.7 else ("" if rng.random() < 0.5 else "gone")
            entry = state(rng.randrange(1, 10_000), parent) if rng.random() < 0.2 else kv(parent)
            index.add(key(name), entry)
            names.append(name)
        elif op < 0.65:
            index.touch(key(rng.choice(names)))
        elif op < 0.75:
            name = rng.choice(names)
            index.remove(key(name))
            names.remove(name)
        elif op < 0.8:
            index.orphan(key(rng.choice(names + ["gone"])))
        else:
            for victim in index.victims(rng.randrange(1, 400), rng.choice([0, 0, 500])):
                names.remove(victim.key.key.decode())
        if step % 50 == 0:
            index.check()
    index.check()
    assert len(index) == len(names)


def test_heaps_stay_bounded_under_reads():
    index = ChunkIndex()
    for i in range(100):
        index.add(key(f"k{i}"), kv())
    for _ in range(10_000):
        index.touch(key(f"k{random.randrange(100)}"))
    assert len(index._by_recency) + len(index._by_value) <= 3 * len(index) + 64 + 1
    index.check()
