"""The restorable index (tiercache.events.restorable) over a real TieredStore: which blocks are advertised for a
hybrid and an attention-only model, the transitions puts, demotions, evictions and a lost chunk cause, each sent
exactly once (a router applying them, as llm-d's refcounted index does, always holds the index's own snapshot), tensor-
parallel ranks, and the inventory after a restart over the disk tier."""

from __future__ import annotations

import numpy as np
import pytest

from testkit.saved_chunks import N, chunks, engine_hash, prompt, refs, spec_of
from tests.events.strict_router import Router
from tests.prefix.chains import ATTENTION, HYBRID, SLIDING
from tiercache.config import Config, DiskTierConfig, HostTierConfig, KiB, MiB, RedisTierConfig
from tiercache.events.blocks import AllBlocksCleared, BlockRemoved, Pod
from tiercache.events.restorable import RestorableIndex
from tiercache.prefix.hashes import token_bytes
from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.objects import ObjectKind, object_meta, object_ref
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore

def make_store(tmp_path, host=4 * MiB, disk=8 * MiB) -> TieredStore:
    return TieredStore.from_config(Config(
        host=HostTierConfig(capacity_bytes=host, page_bytes=4 * KiB, shared_memory=False),
        disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=disk), redis=RedisTierConfig()))


class Saver:
    """Saves a prompt's objects into the store as the connectors do (testkit/saved_chunks.py), in each rank."""

    def __init__(self, store: TieredStore, layout: ModelLayout, ranks: int = 1, payload_bytes: int = 1000) -> None:
        self.store = store
        self.specs = [spec_of(layout, r, ranks) for r in range(ranks)]
        self.spec = self.specs[0]
        self.payload_bytes = payload_bytes

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(s.namespace for s in self.specs)

    def refs(self, tokens, kv: int = 0):
        return refs(self.spec, tokens, kv)

    def save(self, tokens, kv: int = 0, states=(), tails=(), ranks=None):
        for rank in (range(len(self.specs)) if ranks is None else ranks):
            # Every rank's shards are named with rank 0's keys (the scheduler's), in the rank's own namespace.
            for chunk in chunks(self.spec, tokens, kv, states, tails, self.payload_bytes, engine=rank == 0):
                self.store.put(ChunkKey(self.specs[rank].namespace, chunk.key), chunk.data, chunk.meta)

    def delete(self, tokens, kv_at: int, rank: int = 0):
        hashes = self.spec.hashes(np.asarray(tokens))
        ref = object_ref(self.spec.shape, hashes, ObjectKind.KV, kv_at, self.spec.shape.anchor)
        self.store.delete([ChunkKey(self.specs[rank].namespace, ref.key)])


def pod_of(saver: Saver, engine_groups=None, **options) -> Pod:
    shape = saver.spec.shape
    return Pod("pod-a", "tiny", saver.namespaces, shape, engine_groups or tuple(range(len(shape.kinds))), **options)


@pytest.fixture
def index_for(tmp_path):
    """index_for(layout, ranks=1) -> (store, saver, index, router): a pod registered, its events applied by flush()."""
    made = []

    def make(layout, ranks: int = 1, advertise: str = "restorable", medium_override: str = "", **store_options):
        store = make_store(tmp_path, **store_options)
        saver = Saver(store, layout, ranks)
        index = RestorableIndex(store, advertise=advertise, medium_override=medium_override)
        router = Router()
        router.apply(index.add_pod(pod_of(saver)))
        made.append(store)
        return store, saver, index, router

    yield make
    for store in made:
        store.close()


def flush(index: RestorableIndex, router: Router) -> list:
    events = index.flush().get("pod-a", [])
    router.apply(events)
    snapshot = Router()
    snapshot.apply(index.snapshot("pod-a"))
    assert snapshot.held == router.held  # what the stream said so far is exactly the inventory
    return events


def test_a_hybrid_block_is_advertised_only_with_a_checkpoint_at_or_after_it(index_for):
    store, saver, index, router = index_for(HYBRID)
    tokens = prompt(1, 100)
    saver.save(tokens, kv=3)
    assert flush(index, router) == []  # kv chunks alone: nothing a hybrid model can resume from
    saver.save(tokens, states=[64])
    events = flush(index, router)
    assert [e.block_hashes for e in events if e.kind == "full_attention"] == \
        [(engine_hash(tokens, 32),), (engine_hash(tokens, 64),)]
    first, second = [e for e in events if e.kind == "full_attention"]
    assert first.parent_block_hash is None and second.parent_block_hash == engine_hash(tokens, 32)
    assert list(second.token_ids) == tokens[32:64] and second.block_size == N
    assert (second.medium, second.locality, second.group_idx) == ("CPU", "LOCAL", 0)
    (mamba,) = [e for e in events if e.kind == "mamba"]  # the checkpoint itself, at a boundary: after block 2
    assert mamba.block_hashes != second.block_hashes and mamba.group_idx == 1  # a name of its own (Dynamo)
    assert mamba.parent_block_hash == second.block_hashes[0] and mamba.token_ids == () and mamba.block_size == 0
    saver.save(tokens, states=[96])
    events = flush(index, router)  # block 3 and its checkpoint: nothing sent twice
    assert [(e.kind, e.parent_block_hash) for e in events] == [("full_attention", engine_hash(tokens, 64)),
                                                              ("mamba", engine_hash(tokens, 96))]
    assert flush(index, router) == []


def test_advertising_attention_blocks_ignores_checkpoints_as_an_engines_own_events_do(index_for):
    store, saver, index, router = index_for(HYBRID, advertise="attention", medium_override="GPU")
    tokens = prompt(1, 100)
    saver.save(tokens, kv=3)
    events = flush(index, router)  # kv chunks alone: what the engine held, not what it can resume from
    assert [e.block_hashes for e in events] == [(engine_hash(tokens, k * N),) for k in (1, 2, 3)]
    assert {e.medium for e in events} == {"GPU"}  # every block labelled with the override
    saver.save(tokens, states=[64])
    assert [e.kind for e in flush(index, router)] == ["mamba"]  # the checkpoint's own block, nothing more
    saver.delete(tokens, kv_at=64)
    removed = [e.block_hashes for e in flush(index, router) if isinstance(e, BlockRemoved) and e.group_idx == 0]
    assert removed == [(engine_hash(tokens, 96),), (engine_hash(tokens, 64),)]  # the chain broke at block 2
    with pytest.raises(ValueError, match="advertise"):
        RestorableIndex(store, advertise="everything")


def test_a_checkpoint_inside_a_block_needs_its_tail_and_advertises_the_blocks_before_it(index_for):
    store, saver, index, router = index_for(HYBRID)
    tokens = prompt(2, 100)
    saver.save(tokens, kv=2, states=[80])
    assert flush(index, router) == []  # a state at 80 without the tail of [64, 80): no hit there
    saver.save(tokens, tails=[80])
    events = flush(index, router)
    assert len(router.blocks(0)) == 2
    (mamba,) = [e for e in events if e.kind == "mamba"]
    assert mamba.block_size == 16 and list(mamba.token_ids) == tokens[64:80]
    assert mamba.parent_block_hash == engine_hash(tokens, 64)


def test_a_lost_chunk_removes_the_branch_below_it_and_only_that(index_for):
    store, saver, index, router = index_for(ATTENTION)
    a, b = prompt(3, 130), prompt(3, 130)
    b[70:] = prompt(4, 60)  # b shares a's first two blocks
    saver.save(a, kv=4)
    saver.save(b, kv=4)
    flush(index, router)
    assert len(router.blocks(0)) == 6  # two shared blocks, two of each branch
    saver.delete(a, 96)  # a's third block: a's fourth is unreachable now
    events = flush(index, router)
    assert all(isinstance(e, BlockRemoved) for e in events)
    assert {e.block_hashes[0] for e in events} == {engine_hash(a, 96), engine_hash(a, 128)}
    assert len(router.blocks(0)) == 4
    saver.delete(a, 32)  # the shared first block: both branches go
    flush(index, router)
    assert router.held == {}


def test_demotion_moves_a_block_from_cpu_to_storage_once(index_for):
    store, saver, index, router = index_for(ATTENTION, host=64 * KiB)
    saver.payload_bytes = 20 * KiB  # a block's object takes 24 KiB of 4 KiB pages: the host tier holds two
    tokens = prompt(5, 200)
    saver.save(tokens, kv=5)
    flush(index, router)
    media = router.blocks(0)
    assert len(media) == 5 and set(media.values()) == {"CPU", "STORAGE"}
    assert sorted(media.values()).count("STORAGE") >= 2


def test_eviction_from_the_last_tier_removes_what_it_broke(index_for):
    store, saver, index, router = index_for(ATTENTION, host=0, disk=200 * KiB)
    saver.payload_bytes = 20 * KiB
    for seed in range(8):  # more than the disk holds: old prompts shrink from their deep end, then go
        saver.save(prompt(10 + seed, 100), kv=3)
        flush(index, router)
    held = router.blocks(0)
    assert 0 < len(held) < 24 and set(held.values()) == {"STORAGE"}


def test_hybrid_with_sliding_window_groups_advertises_the_chunks_held(index_for):
    store, saver, index, router = index_for(SLIDING)
    tokens = prompt(6, 100)
    saver.save(tokens, kv=3)
    flush(index, router)
    assert [len(router.blocks(g, kind)) for g, kind in ((0, "sliding_window"), (1, "full_attention"),
                                                         (2, "sliding_window"))] == [3, 3, 3]


def test_every_rank_must_hold_a_block(index_for):
    store, saver, index, router = index_for(HYBRID, ranks=2)
    tokens = prompt(7, 100)
    saver.save(tokens, kv=3, states=[96], ranks=[0])
    assert flush(index, router) == []
    saver.save(tokens, kv=3, states=[96], ranks=[1])
    flush(index, router)
    assert len(router.blocks(0)) == 3
    saver.delete(tokens, 64, rank=1)
    flush(index, router)
    assert router.blocks(0) == {}  # the only checkpoint is past the hole in rank 1's chain


def test_blocks_without_tokens_are_not_advertised(index_for):
    store, saver, index, router = index_for(ATTENTION)
    tokens = prompt(8, 100)
    for ref in saver.refs(tokens, kv=3):  # an old connector: no tokens, no hash
        store.put(ChunkKey(saver.spec.namespace, ref.key), b"x" * 100, object_meta(ref))
    assert flush(index, router) == []


def test_the_inventory_survives_a_restart_over_the_disk_tier(tmp_path):
    store = make_store(tmp_path, host=0)
    saver = Saver(store, HYBRID)
    tokens = prompt(9, 100)
    saver.save(tokens, kv=3, states=[64, 96])
    index = RestorableIndex(store)
    before = index.add_pod(pod_of(saver))
    store.close()
    store = make_store(tmp_path, host=0)
    after = RestorableIndex(store).add_pod(pod_of(Saver(store, HYBRID)))
    store.close()
    assert isinstance(before[0], AllBlocksCleared) and len(before) == 1 + 3 + 2
    assert sorted(map(repr, after)) == sorted(map(repr, before))
    assert {e.medium for e in after[1:]} == {"STORAGE"}


def test_a_read_promotes_a_block_back_to_cpu(index_for):
    store, saver, index, router = index_for(ATTENTION, host=64 * KiB)
    saver.payload_bytes = 20 * KiB
    tokens = prompt(11, 200)
    saver.save(tokens, kv=5)
    flush(index, router)
    keys = {k: ChunkKey(saver.spec.namespace, ref.key) for k, ref in enumerate(saver.refs(tokens, kv=5), 1)}
    k = next(k for k, key in keys.items() if store.locate([key]) == ["disk"])
    assert router.blocks(0)[engine_hash(tokens, k * N)] == "STORAGE"
    store.get(keys[k])  # promoted to the host tier
    events = flush(index, router)
    moved = [(type(e).__name__, e.medium) for e in events if e.block_hashes == (engine_hash(tokens, k * N),)]
    assert moved == [("BlockRemoved", "STORAGE"), ("BlockStored", "CPU")]


def test_without_an_engine_hash_the_chain_hash_names_the_block(index_for):
    store, saver, index, router = index_for(ATTENTION)
    tokens = prompt(12, 40)
    (ref,) = saver.refs(tokens, kv=1)
    meta = object_meta(ref)._replace(tokens=token_bytes(tokens[:32]))  # tokens, but no engine hash (SGLang, say)
    store.put(ChunkKey(saver.spec.namespace, ref.key), b"x" * 100, meta)
    (event,) = flush(index, router)
    assert event.block_hashes == (int.from_bytes(ref.key[:8], "big"),) and event.parent_block_hash is None
