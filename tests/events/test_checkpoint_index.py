"""The checkpoint-aware index (testkit/checkpoint_index.py) on batches shaped as tiercache sends them: a
hybrid model's attention blocks and its checkpoints' `mamba` blocks (own hash, parent block, tokens since it). It
scores the deepest checkpoint whose tokens follow in the prompt, to the token, on the pod's matched path, one token
short of the prompt's end at most; refcounted removals by the checkpoint's hash; clears; the attention index stays
llm-d's."""

from __future__ import annotations

import pytest

from testkit.checkpoint_index import CheckpointIndex
from tests.events.test_llmd_index import N, TOPIC, chain, payload, removed, stored, tokens

STATE_GROUP = 1


def checkpoint(own: int, parent: int, tail, medium="CPU", group=STATE_GROUP) -> dict:
    return stored([own], parent, tail, medium=medium, group=group, kind="mamba", block_size=len(tail))


def test_a_checkpoint_counts_its_tokens_past_its_block_where_they_follow_in_the_prompt():
    index = CheckpointIndex()
    toks = tokens(1, 3)
    chain(index, toks[:2 * N])  # blocks 100, 101
    index.apply(TOPIC, payload(checkpoint(7, 100, ()), checkpoint(8, 101, toks[2 * N:2 * N + 5])))
    assert index.score(toks, "tiny") == {"pod-a": (2 * N + 5, pytest.approx(0.8 * (2 * N + 5) / 16))}
    assert index.matched_tokens(toks[:2 * N + 6], "tiny", "pod-a") == 2 * N + 5
    # The engine computes the last token: a checkpoint at the prompt's very end does not count.
    assert index.matched_tokens(toks[:2 * N + 5], "tiny", "pod-a") == N
    # A prompt that leaves the checkpoint's tokens resumes at the boundary checkpoint before it.
    diverging = toks[:2 * N + 3] + [1] + toks[2 * N + 4:]
    assert index.matched_tokens(diverging, "tiny", "pod-a") == N
    # llm-d's own count is unchanged: whole canonical keys the pod holds, checkpoints ignored.
    assert index.attention.matched_tokens(toks, "tiny", "pod-a") == 2 * N
    assert index.attention.skipped["unsupported_cache_kind"] == 2


def test_blocks_without_a_checkpoint_count_nothing_and_a_checkpoint_needs_no_walk_of_shared_keys():
    index = CheckpointIndex()
    toks = tokens(2, 2)
    chain(index, toks)
    assert index.score(toks + [5], "tiny") == {}  # attention blocks alone: no checkpoint, nothing to resume at
    index.apply(TOPIC, payload(checkpoint(9, 101, ())))
    assert index.matched_tokens(toks + [5], "tiny", "pod-a") == 2 * N
    # A second first block sharing the first one's first 16 tokens (a system prompt), then evicted: llm-d's rules
    # drop the pod from every key of that block, shared ones included, and its walk stops at key 0. The checkpoint's
    # own key chains every token before it: it still counts.
    other = toks[:16] + tokens(3, 1)[16:]
    index.apply(TOPIC, payload(stored([300], None, other), removed([300])))
    assert index.attention.score(toks, "tiny") == {}
    assert index.matched_tokens(toks + [5], "tiny", "pod-a") == 2 * N


def test_a_checkpoint_is_removed_by_its_own_hash_refcounted_per_medium_and_group():
    index = CheckpointIndex()
    toks = tokens(3, 1)
    chain(index, toks)
    tail = [11, 12, 13]
    prompt = toks + tail + [5]
    index.apply(TOPIC, payload(checkpoint(7, 100, tail), checkpoint(7, 100, tail),
                               checkpoint(7, 100, tail, medium="STORAGE")))
    index.apply(TOPIC, payload(removed([7], group=STATE_GROUP)))
    assert index.matched_tokens(prompt, "tiny", "pod-a") == N + 3  # one CPU store left, and STORAGE
    index.apply(TOPIC, payload(removed([7], group=STATE_GROUP)))
    assert index.score(prompt, "tiny")["pod-a"] == (N + 3, pytest.approx((N + 3) / 16 * 1.0))  # its state's tier
    index.apply(TOPIC, payload(removed([7], medium="STORAGE", group=STATE_GROUP)))
    assert index.score(prompt, "tiny") == {} and not index.checkpoints
    assert index.attention.matched_tokens(prompt, "tiny", "pod-a") == N  # the block's removal is another event


def test_pods_are_scored_on_their_own_checkpoints_and_cleared_alone():
    index = CheckpointIndex()
    toks = tokens(4, 2)
    chain(index, toks)
    chain(index, toks, topic="kv@pod-b@tiny")
    index.apply(TOPIC, payload(checkpoint(7, 101, ())))
    index.apply("kv@pod-b@tiny", payload(checkpoint(8, 100, toks[N:N + 9])))
    assert index.score(toks + [5], "tiny") == {"pod-a": (2 * N, pytest.approx(0.8 * 2 * N / 16)),
                                               "pod-b": (N + 9, pytest.approx(0.8 * (N + 9) / 16))}
    assert set(index.score(toks + [5], "tiny", ["pod-b"])) == {"pod-b"}
    index.apply(TOPIC, payload({"type": "AllBlocksCleared"}))
    assert set(index.score(toks + [5], "tiny")) == {"pod-b"} and set(index.attention.score(toks, "tiny")) == {"pod-b"}


def test_a_checkpoint_whose_block_was_never_indexed_is_skipped():
    index = CheckpointIndex()
    toks = tokens(5, 1)
    index.apply(TOPIC, payload(checkpoint(7, 100, toks[:3])))  # block 100 unknown
    index.apply(TOPIC, payload(checkpoint(8, 0, toks[:3])))  # no parent (tiercache never sends one)
    assert index.skipped == {"unresolved_parent": 2} and index.score(toks + [1, 2, 3, 4], "tiny") == {}
    assert not index.apply(TOPIC, b"\xc1") and index.attention.skipped["undecodable_batch"] == 1
