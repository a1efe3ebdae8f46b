"""The llm-d-rules index (testkit/llmd_index.py) on batches in both of vLLM's encodings: what it keeps and
skips, parents, canonical request keys, refcounted removals, clears, LongestPrefixScorer, and the subscriber's
sequence rules (replay on connect, gaps, restarts, bad replays)."""

from __future__ import annotations

import random

import msgpack
import pytest

from testkit.llmd_index import BLOCK_STORED_FIELDS, LlmdIndex, Source, parse_topic

N = 32  # the events' block size: two canonical (16-token) blocks each
TOPIC = "kv@pod-a@tiny"


def tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 50_000) for _ in range(blocks * N)]


def stored(hashes, parent, toks, medium="CPU", group=0, kind="full_attention", block_size=N, lora=None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": list(toks),
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora, "group_idx": group,
            "kv_cache_spec_kind": kind}


def removed(hashes, medium="CPU", group=0) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group}


def as_array(event: dict) -> list:
    """The positional form (older vLLMs): tag, then the fields in vLLM's order, trailing Nones left out."""
    order = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium", "group_idx")}
    fields = [event["type"], *(event.get(name) for name in order.get(event["type"], ()))]
    while len(fields) > 1 and fields[-1] is None:
        fields.pop()
    return fields


def payload(*events, array: bool = False) -> bytes:
    return msgpack.packb([1.0, [as_array(e) if array else e for e in events], 0])


def chain(index: LlmdIndex, toks: list[int], first_hash: int = 100, array: bool = False, topic=TOPIC, **kw) -> None:
    """One BlockStored per N-token block, each the previous one's child."""
    parent = None
    for k in range(len(toks) // N):
        index.apply(topic, payload(stored([first_hash + k], parent, toks[k * N:(k + 1) * N], **kw), array=array))
        parent = first_hash + k


def test_topics_name_the_pod_and_the_model():
    assert parse_topic(b"kv@pod-a@Qwen/Qwen3.5-0.8B") == ("pod-a", "Qwen/Qwen3.5-0.8B")
    assert parse_topic("other") == ("other", "")


@pytest.mark.parametrize("array", [False, True])
def test_a_chain_scores_its_tokens_at_the_canonical_block_size_in_both_encodings(array):
    index = LlmdIndex()
    toks = tokens(1, 3)
    chain(index, toks, array=array)
    prompt = toks + [7] * 40
    assert index.score(prompt, "tiny") == {"pod-a": (3 * N, pytest.approx(0.8 * 3 * N / 16))}  # cpu weighs 0.8
    assert index.score(toks[:N + 20], "tiny")["pod-a"][0] == N + 16  # a prompt's partial canonical block never counts
    assert index.score(toks, "other-model") == {}  # the model seeds the keys
    diverging = toks[:N + 5] + [1] + toks[N + 6:]
    assert index.matched_tokens(diverging, "tiny", "pod-a") == N  # keys after a difference never match


def test_tiers_weigh_as_llm_d_default_and_every_key_counts_its_best_tier():
    index = LlmdIndex()
    toks = tokens(2, 2)
    index.apply(TOPIC, payload(stored([1], None, toks[:N], medium="GPU"), stored([2], 1, toks[N:], medium="STORAGE")))
    index.apply(TOPIC, payload(stored([1], None, toks[:N], medium="CPU")))  # the same block on a second tier
    assert index.score(toks, "tiny") == {"pod-a": (2 * N, pytest.approx(2 * 1.0 + 2 * 1.0))}  # gpu 1, storage 1


def test_only_attention_kinds_and_dense_events_are_indexed():
    index = LlmdIndex()
    toks = tokens(3, 1)
    index.apply(TOPIC, payload(stored([1], None, toks, kind="mamba", group=1),
                               stored([2], None, toks, kind="sliding_window", group=2),
                               stored([3], None, toks[:20], block_size=20 + 1)))  # sparse: 20 tokens for 21
    assert index.score(toks, "tiny") == {}
    assert index.skipped == {"unsupported_cache_kind": 2, "non_dense_block_span": 1}
    index.apply(TOPIC, payload(stored([4], None, toks, kind=None, group=None)))  # legacy: no group, indexed
    index.apply(TOPIC, payload(stored([5], None, toks, kind="mla_attention", group=3)))
    assert index.score(toks, "tiny")["pod-a"][0] == N


def test_an_unresolved_parent_drops_the_whole_event_and_parents_chain_request_keys():
    index = LlmdIndex()
    toks = tokens(4, 2)
    index.apply(TOPIC, payload(stored([2], 1, toks[N:])))  # parent 1 unknown: dropped
    assert index.skipped["unresolved_parent"] == 1 and index.holders == {}
    index.apply(TOPIC, payload(stored([1], None, toks[:N])))
    index.apply(TOPIC, payload(stored([2], 1, toks[N:])))
    assert index.score(toks, "tiny")["pod-a"][0] == 2 * N
    assert index.score(toks[N:], "tiny") == {}  # the second block's keys are chained from the first's


def test_an_event_of_many_blocks_maps_its_engine_keys_to_their_request_keys():
    index = LlmdIndex()
    toks = tokens(5, 3)
    index.apply(TOPIC, payload(stored([1, 2, 3], None, toks)))
    index.apply(TOPIC, payload(removed([3])))
    assert index.score(toks, "tiny")["pod-a"][0] == 2 * N
    index.apply(TOPIC, payload(stored([4], 2, toks[2 * N:])))  # parent 2 resolves to its last request key
    assert index.score(toks, "tiny")["pod-a"][0] == 3 * N


def test_removals_are_refcounted_per_pod_medium_and_group_and_need_a_known_group():
    index = LlmdIndex()
    toks = tokens(6, 1)
    index.apply(TOPIC, payload(removed([1], group=5)))
    assert index.skipped["unknown_group"] == 1
    index.apply(TOPIC, payload(stored([1], None, toks), stored([1], None, toks)))  # stored twice
    index.apply(TOPIC, payload(stored([1], None, toks, medium="STORAGE")))
    index.apply(TOPIC, payload(removed([1])))
    assert index.score(toks, "tiny")["pod-a"][0] == N  # one store of (CPU, 0) still holds it
    index.apply(TOPIC, payload(removed([1])))
    assert index.score(toks, "tiny")["pod-a"] == (N, pytest.approx(2 * 1.0))  # left: STORAGE only
    index.apply(TOPIC, payload(removed([1], medium="STORAGE")))
    assert index.score(toks, "tiny") == {}


def test_all_blocks_cleared_clears_one_pod_and_pods_must_hold_every_key_from_the_first():
    index = LlmdIndex()
    toks = tokens(7, 2)
    chain(index, toks)
    chain(index, toks, first_hash=200, topic="kv@pod-b@tiny", medium="GPU")
    index.apply("kv@pod-c@tiny", payload(stored([300], None, toks[N:])))  # pod c: only the second block's tokens
    scores = index.score(toks, "tiny")
    assert scores == {"pod-a": (2 * N, pytest.approx(3.2)), "pod-b": (2 * N, pytest.approx(4.0))}
    assert index.score(toks, "tiny", ["pod-b"]) == {"pod-b": (2 * N, pytest.approx(4.0))}
    index.apply(TOPIC, payload({"type": "AllBlocksCleared"}))
    assert set(index.score(toks, "tiny")) == {"pod-b"}


def test_a_batch_with_an_undecodable_event_is_dropped_whole():
    index = LlmdIndex()
    toks = tokens(8, 1)
    assert not index.apply(TOPIC, payload(stored([1], None, toks), {"no": "type"}))
    assert not index.apply(TOPIC, b"\xc1")
    assert index.score(toks, "tiny") == {} and index.skipped["undecodable_batch"] == 2


class Stream:
    """A publisher's frames by seq, and a record of what a Source did with them."""

    def __init__(self, frames: int) -> None:
        self.frames = {seq: f"p{seq}".encode() for seq in range(frames)}
        self.delivered: list[int] = []
        self.resets = 0
        self.broken = False

    def source(self) -> Source:
        return Source(lambda seq, _: self.delivered.append(seq), self.replay, self.reset)

    def replay(self, start: int):
        seqs = sorted(s for s in self.frames if s >= start)
        if self.broken:
            seqs = seqs[1:]
        return [(s, self.frames[s]) for s in seqs]

    def reset(self) -> None:
        self.resets += 1
        self.delivered.clear()


def test_a_source_replays_on_connect_repairs_gaps_and_drops_repeats():
    stream = Stream(3)
    source = stream.source()
    source.connect()
    assert stream.delivered == [0, 1, 2]
    source.live(2, b"p2")  # already replayed
    stream.frames.update({3: b"p3", 4: b"p4"})
    source.live(4, b"p4")  # 3 missed: replay from 3
    source.live(4, b"p4")
    assert stream.delivered == [0, 1, 2, 3, 4]
    stream.frames[5] = b"p5"
    source.live(5, b"p5")
    assert stream.delivered == [0, 1, 2, 3, 4, 5] and stream.resets == 0


def test_a_source_joining_mid_stream_replays_from_zero_and_a_restarted_publisher_is_rebuilt():
    stream = Stream(6)
    source = stream.source()
    source.live(5, b"p5")
    assert stream.delivered == [0, 1, 2, 3, 4, 5]
    stream.frames = {0: b"q0", 1: b"q1"}  # a new incarnation: seqs from 0 again
    source.live(1, b"q1")
    assert stream.resets == 1 and stream.delivered == [0, 1]


def test_a_replay_with_missing_seqs_resets_the_source_and_cools_down():
    stream = Stream(4)
    stream.broken = True
    source = stream.source()
    source.live(3, b"p3")
    assert stream.resets == 1 and stream.delivered == []
    stream.broken = False
    source.live(4, b"p4")  # in the cooldown: no replay, nothing delivered without a base
    assert stream.delivered == [] and source.replays == 1
