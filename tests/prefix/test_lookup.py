"""The Lookup search (tiercache.prefix.lookup) and the hit rule (tiercache.prefix.hit) on hand-built cases (pure
functions; the 'server' is a set of keys). Admission: tests/prefix/test_admission.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tiercache.prefix.admission import plan_prompt_admission
from tiercache.prefix.objects import CacheSpec, ObjectKind

from tests.prefix.chains import ATTENTION, HYBRID, N, SLIDING, U, FakeCache, tokens


@pytest.fixture
def cache():
    return FakeCache(CacheSpec(HYBRID, N, U))


@pytest.mark.parametrize("length", [2, 5, 17, 31, 32, 33, 63, 64, 100])
def test_exact_repeat_hits_all_but_the_last_token(cache, length):
    prompt = tokens(length)
    assert cache.prefill(prompt) == 0
    assert cache.prefill(prompt) == length - 1


def test_one_token_prompt_never_hits(cache):
    cache.prefill(tokens(1))
    assert cache.prefill(tokens(1)) == 0


def test_prefix_diverging_mid_chunk_hits_the_deepest_boundary_state(cache):
    first = tokens(100)
    cache.prefill(first)  # boundary states at 32, 64, 96
    second = first.copy()
    second[75:] = tokens(25, seed=9)
    assert cache.prefill(second) == 64


def test_missing_boundary_state_falls_back_to_an_earlier_one(cache):
    first = tokens(130)
    cache.prefill(first)  # boundary states at 32, 64, 96 and 128
    second = first.copy()
    second[110:] = tokens(20, seed=9)
    assert cache.lookup(second)[1].tokens == 96
    cache.drop(ObjectKind.STATE, 96)
    assert cache.lookup(second)[1].tokens == 64  # the next one down
    cache.drop(ObjectKind.STATE, 64)
    assert cache.lookup(second)[1].tokens == 32


def test_kv_gap_limits_the_hit_even_with_a_deeper_state(cache):
    first = tokens(100)
    cache.prefill(first)
    cache.drop(ObjectKind.KV, 32)
    assert cache.prefill(first) == 0


def test_chat_turn_hits_the_previous_turns_end(cache):
    prompt, output = tokens(70), tokens(15, seed=1)
    cache.prefill(prompt)
    conversation = np.concatenate([prompt, output])
    cache.finish(conversation, len(prompt))
    next_prompt = np.concatenate([conversation, tokens(12, seed=2)])
    assert cache.prefill(next_prompt) == len(conversation)  # 85: exact, not rounded to u or N


def test_previous_end_far_back_is_found_in_two_calls(cache):
    prompt = tokens(70)
    cache.prefill(prompt)
    cache.finish(prompt, len(prompt))
    cache.calls = 0
    longer = np.concatenate([prompt, tokens(40, seed=2)])  # the end at 70 is 40 tokens (> N) back
    assert cache.prefill(longer) == 70
    assert cache.calls == 2  # the first names 70 (and 69) unverified, the second checks their hashes


def test_other_prompts_checkpoints_in_the_last_chunk_cost_no_second_call(cache):
    """Questions on one document leave their ends in the document's last chunk; the server hashes that chunk's
    positions itself (the request carries its tokens), so the next question is answered in one call."""
    document = tokens(100)
    for q in range(4):
        cache.calls = 0
        hit = cache.prefill(np.concatenate([document, tokens(5 + q, seed=30 + q)]))
        assert cache.calls == 1 and hit == (96 if q else 0)


@pytest.mark.parametrize("added", [int(1.2 * N), 2 * N, 3 * N, 5 * N + 3])
def test_long_chat_turns_resume_at_the_previous_end(cache, added):
    conversation, previous_end = tokens(45), 0
    for turn in range(4):
        hit = cache.prefill(conversation)
        assert hit == previous_end
        output = tokens(7, seed=100 + turn)
        conversation = np.concatenate([conversation, output])
        cache.finish(conversation, len(conversation) - len(output))
        previous_end = len(conversation)
        conversation = np.concatenate([conversation, tokens(added, seed=200 + turn)])


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_branches_resume_within_n_of_the_branch_point(cache, share):
    document = tokens(1000)
    cache.prefill(np.concatenate([document, tokens(20, seed=1)]))
    shared = int(share * len(document))
    branch = np.concatenate([document[:shared], tokens(30, seed=2)])
    hit = cache.prefill(branch)
    assert shared - N < hit <= shared


def test_a_checkpoint_of_another_prompt_in_the_same_chunk_is_no_hit(cache):
    first = tokens(50)
    cache.prefill(first)  # tail + state at 49, under the kv chunk at 32
    second = first.copy()
    second[40:] = tokens(10, seed=3)  # same chunk 1, different tokens before 49
    assert cache.lookup(second)[1].tokens == 32


def test_262144_token_lookup_is_one_call_and_names_every_object():
    fake = FakeCache(CacheSpec(HYBRID, 544, 16))
    prompt = tokens(262_144)
    fake.prefill(prompt)
    fake.calls = 0
    hit = fake.lookup(prompt)[1]
    assert hit.tokens == 262_143 and fake.calls == 1
    assert len(hit.objects) == 262_143 // 544 + 2  # every kv chunk, the tail, the state
    sibling = prompt.copy()
    sibling[100_000:] = tokens(262_144 - 100_000, seed=5)
    assert 100_000 - 544 < fake.lookup(sibling)[1].tokens <= 100_000


def test_262144_token_document_with_different_questions():
    fake = FakeCache(CacheSpec(HYBRID, 544, 16))
    document = tokens(262_144)
    hits = [fake.prefill(np.concatenate([document, tokens(40, seed=q)])) for q in range(3)]
    assert hits[0] == 0 and min(hits[1:]) >= 262_144 - 544


def test_pure_attention_model_needs_no_state():
    fake = FakeCache(CacheSpec(ATTENTION, N, U))
    prompt = tokens(90)
    fake.prefill(prompt)
    assert fake.prefill(prompt) == 89
    other = prompt.copy()
    other[50:] = 7
    assert fake.prefill(other) == 32  # kv chain only: no per-position state needed at a boundary
    plan = plan_prompt_admission(fake.spec, fake.spec.hashes(prompt), 0)
    assert plan.state_positions == () and {r.kind for r in plan.objects} == {ObjectKind.KV, ObjectKind.TAIL}


def test_sliding_window_group_needs_only_recent_chunks():
    spec = CacheSpec(SLIDING, N, U)
    fake = FakeCache(spec)
    prompt = tokens(200)
    fake.prefill(prompt)
    for k in (1, 2, 3):  # drop old chunks of both sliding-window groups (groups 0 and 2)
        for key, ref in list(fake.keys.items()):
            if ref.kind is ObjectKind.KV and ref.position == k * N and ref.group in (0, 2):
                del fake.keys[key]
    assert fake.lookup(prompt)[1].tokens == 199  # full attention has every chunk; the windows reach back < 40


def test_sliding_window_gap_inside_the_window_limits_the_hit():
    fake = FakeCache(CacheSpec(SLIDING, N, U))
    prompt = tokens(200)
    fake.prefill(prompt)
    for key, ref in list(fake.keys.items()):
        if ref.kind is ObjectKind.KV and ref.position == 160 and ref.group == 2:
            del fake.keys[key]  # chunk [128, 160) of the 40-token window group
    # Any p in (128, 200) needs that chunk for the 40-token window; p = 128 needs only chunks up to it.
    assert fake.lookup(prompt)[1].tokens == 128


def test_tokens_by_tier_attributes_kv_tokens(cache):
    prompt = tokens(100)
    cache.prefill(prompt)
    hit = cache.lookup(prompt)[1]
    by_kind = {(o.ref.kind, o.ref.position): o for o in hit.objects}
    located = [dataclasses.replace(o, tier="disk") if (o.ref.kind, o.ref.position) == (ObjectKind.KV, 32) else o
               for o in by_kind.values()]
    assert hit.tokens == 99
    assert dataclasses.replace(hit, objects=tuple(located)).tokens_by_tier() == {"disk": 32, "host": 67}
