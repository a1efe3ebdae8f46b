"""The restorable index stays current incrementally (tiercache.events.restorable): after every flush of a randomized
run of saves, deletions, reads (promotions), demotions and evictions over a real TieredStore, what it advertises is
exactly what a fresh index recomputes from scratch over the same store; and a put at a leaf of a deep shared tree
(a common system prompt) costs work along its path, not over the whole tree."""

from __future__ import annotations

import random

import pytest

from testkit.saved_chunks import N, U, prompt
from tests.events.strict_router import Router
from tests.events.test_restorable import Saver, flush, make_store, pod_of
from tests.prefix.chains import ATTENTION, HYBRID
from tiercache.config import KiB
from tiercache.events.blocks import BlockRemoved
from tiercache.events.restorable import RestorableIndex
from tiercache.record.keys import ChunkKey


def from_scratch(store, saver: Saver, advertise: str) -> list[str]:
    """What a fresh index over the same store advertises (its add_pod walks every tree)."""
    fresh = RestorableIndex(store, advertise=advertise)
    events = fresh.add_pod(pod_of(saver))
    fresh.remove_pod("pod-a")  # it stops taking note of the store
    return sorted(map(repr, events[1:]))


@pytest.mark.parametrize("layout, ranks, advertise", [(HYBRID, 2, "restorable"), (ATTENTION, 1, "restorable"),
                                                      (HYBRID, 1, "attention")], ids=["hybrid-tp2", "attention",
                                                                                      "hybrid-advertise-attention"])
def test_the_index_advertises_what_a_recompute_from_scratch_does_after_every_flush(tmp_path, layout, ranks,
                                                                                   advertise):
    store = make_store(tmp_path, host=96 * KiB, disk=192 * KiB)
    saver = Saver(store, layout, ranks, payload_bytes=3000)  # one 4 KiB page each: the tiers hold a few dozen
    index = RestorableIndex(store, advertise=advertise)
    router = Router()
    router.apply(index.add_pod(pod_of(saver)))
    rng = random.Random(27)
    system = prompt(100, 3 * N)  # a shared system prompt: most trees are one
    prompts = [system + prompt(200 + i, 4 * N + 4) for i in range(6)] + [prompt(300 + i, 5 * N) for i in range(2)]
    seen = {"removed": 0, "media": set()}
    for step in range(80):
        tokens = rng.choice(prompts)
        blocks = len(tokens) // N
        op = rng.random()
        if op < 0.6:
            kv = rng.randint(1, blocks)
            states = sorted(rng.sample(range(U, len(tokens) + 1, U), 2))
            tails = [p for p in states if p % N and rng.random() < 0.8]
            saver.save(tokens, kv=kv, states=states, tails=tails,
                       ranks=rng.choice([None, None, [0], [1]]) if ranks == 2 else None)
        elif op < 0.8:
            saver.delete(tokens, kv_at=rng.randint(1, blocks) * N, rank=rng.randrange(ranks))
        else:
            for ref in saver.refs(tokens, kv=rng.randint(1, blocks)):  # a read promotes what it finds below
                store.get(ChunkKey(saver.spec.namespace, ref.key))
        events = flush(index, router)  # the stream so far is the index's inventory, nothing sent twice
        seen["removed"] += sum(isinstance(e, BlockRemoved) for e in events)
        seen["media"] |= {e.medium for e in events}
        assert sorted(map(repr, index.snapshot("pod-a")[1:])) == from_scratch(store, saver, advertise), step
    assert seen["removed"] > 0 and seen["media"] == {"CPU", "STORAGE"}  # not vacuous: demotions and losses


def test_a_put_at_a_leaf_of_a_deep_shared_tree_costs_its_path_not_the_tree(tmp_path):
    store = make_store(tmp_path)
    saver = Saver(store, HYBRID)
    index = RestorableIndex(store)
    router = Router()
    router.apply(index.add_pod(pod_of(saver)))
    system = prompt(400, 20 * N)
    branches = [system + prompt(500 + i, 3 * N) for i in range(30)]  # 20 shared blocks, 30 branches of 3: 110 nodes
    for tokens in branches:
        saver.save(tokens, kv=23, states=[k * N for k in range(1, 24)])
    flush(index, router)
    assert len(router.blocks(0)) == 110
    tokens = branches[7] + prompt(600, N)
    before = index.effort
    saver.save(tokens, kv=24, states=[24 * N])  # the connector saves the whole prompt again: 23 chunks held, 1 new
    events = flush(index, router)
    assert [e.kind for e in events] == ["full_attention", "mamba"]
    nodes, searches, adverts = (after - b for after, b in zip(index.effort, before))
    # The new leaf and its parent (a new child) are read, one checkpoint each tried; the 23 chunks put again only
    # moved (their media are checked). A recompute of the tree would read 111 nodes and try 111 checkpoints.
    assert (nodes, searches) == (2, 2)
    assert adverts <= 24
