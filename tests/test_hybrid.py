"""The hit rule and admission on hand-built cases (pure functions; the 'server' is a set of keys)."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.hybrid import (CacheSpec, ObjectKind, plan_finish_admission, plan_probe, plan_prompt_admission,
                              plan_step_admission, resolve_hit)
from tiercache.layout import GroupKind, LayerGroup, ModelLayout, StateTensor

N, U = 32, 8
STATE = (StateTensor("ssm", (2, 4, 4), "float32"),)


def layout(*groups) -> ModelLayout:
    return ModelLayout("tiny", tuple(groups))


HYBRID = layout(LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=4),
                LayerGroup(GroupKind.RECURRENT, (1, 2), state=STATE))
ATTENTION = layout(LayerGroup(GroupKind.FULL_ATTENTION, (0, 1), kv_heads=1, head_dim=4))
SLIDING = layout(LayerGroup(GroupKind.SLIDING_WINDOW, (0,), kv_heads=1, head_dim=4, window=20),
                 LayerGroup(GroupKind.FULL_ATTENTION, (1,), kv_heads=1, head_dim=4),
                 LayerGroup(GroupKind.SLIDING_WINDOW, (2,), kv_heads=1, head_dim=4, window=40))


class FakeCache:
    """A set of keys standing in for the server: enough to exercise the rules without I/O."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.keys: dict[bytes, object] = {}

    def lookup(self, tokens):
        hashes = self.spec.hashes(tokens)
        probe = plan_probe(self.spec, hashes)
        where = ["host" if k in self.keys else None for k in probe.keys]
        hit = resolve_hit(self.spec, hashes, probe, where)
        present = {ref.key: "host" for ref, w in zip(probe.objects, where) if w}
        return hashes, hit, present

    def prefill(self, tokens) -> int:
        """Look up, then save what admission plans, as an engine would; returns the hit."""
        hashes, hit, present = self.lookup(tokens)
        for ref in plan_prompt_admission(self.spec, hashes, hit.tokens, present).objects:
            self.keys[ref.key] = ref
        return hit.tokens

    def finish(self, tokens, prompt_tokens: int) -> None:
        for ref in plan_finish_admission(self.spec, self.spec.hashes(tokens), prompt_tokens).objects:
            self.keys[ref.key] = ref

    def drop(self, kind: ObjectKind, position: int) -> None:
        for key, ref in list(self.keys.items()):
            if ref.kind is kind and ref.position == position:
                del self.keys[key]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


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
    cache.prefill(first)  # boundary states at 32, 64, 96 (spacing 1, 2, 4 chunks back: 96, 64, 32)
    second = first.copy()
    second[75:] = tokens(25, seed=9)
    assert cache.prefill(second) == 64


def test_missing_boundary_state_falls_back_to_an_earlier_one(cache):
    first = tokens(130)
    cache.prefill(first)  # boundary states at 128, 96 and 32
    second = first.copy()
    second[110:] = tokens(20, seed=9)
    assert cache.lookup(second)[1].tokens == 96
    cache.drop(ObjectKind.STATE, 96)
    assert cache.lookup(second)[1].tokens == 32  # no state at 64: the next one down


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


def test_previous_end_beyond_the_window_falls_back_to_a_boundary(cache):
    prompt = tokens(70)
    cache.prefill(prompt)
    cache.finish(prompt, len(prompt))
    longer = np.concatenate([prompt, tokens(40, seed=2)])  # the end at 70 is 40 tokens back: window is N=32
    assert cache.prefill(longer) == 64


def test_probe_is_bounded_for_262144_tokens():
    spec = CacheSpec(HYBRID, 544, 16)
    hashes = spec.hashes(tokens(262_144))
    probe = plan_probe(spec, hashes)
    assert len(probe.objects) <= 2 * (262_144 // 544) + 2 * 544
    present_all = resolve_hit(spec, hashes, probe, ["disk"] * len(probe.objects))
    assert present_all.tokens == 262_143
    assert len(present_all.objects) == 262_143 // 544 + 2  # every kv chunk, the tail, the state


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


def test_admission_saves_nothing_twice(cache):
    prompt = tokens(100)
    cache.prefill(prompt)
    hashes, hit, present = cache.lookup(prompt)
    assert plan_prompt_admission(cache.spec, hashes, hit.tokens, present).objects == ()


def test_admission_plan_for_a_cold_prompt(cache):
    hashes = cache.spec.hashes(tokens(300))
    plan = plan_prompt_admission(cache.spec, hashes, 0)
    kinds = {(r.kind, r.position) for r in plan.objects}
    assert {(ObjectKind.KV, k * N) for k in range(1, 10)} <= kinds  # every full chunk, 288 = 9 * 32
    boundary_states = sorted(p for k, p in kinds if k is ObjectKind.STATE and p % N == 0)
    assert boundary_states == [64, 192, 256, 288]  # chunks 9, 8, 6, 2: the spacing doubles going back
    assert (ObjectKind.TAIL, 299) in kinds and (ObjectKind.STATE, 299) in kinds
    assert plan.state_positions == (64, 192, 256, 288, 299)


def test_tokens_by_tier_attributes_kv_tokens():
    spec = CacheSpec(HYBRID, N, U)
    hashes = spec.hashes(tokens(100))
    probe = plan_probe(spec, hashes)
    where = ["disk" if r.kind is ObjectKind.KV and r.position == 32 else "host" for r in probe.objects]
    hit = resolve_hit(spec, hashes, probe, where)
    assert hit.tokens == 99 and hit.tokens_by_tier() == {"disk": 32, "host": 67}


def _planned(plan) -> list[tuple[str, int]]:
    return sorted({(ref.kind.name, ref.position) for ref in plan.objects})


def test_step_admission_keeps_the_states_the_prompt_admission_wants():
    """An engine that keeps states where it chose (vLLM) offers them step by step; the shared rule admits the same
    boundary states as plan_prompt_admission (spaced 1, 2, 4 chunks back from the end) and the prompt's end."""
    spec = CacheSpec(HYBRID, N, U)
    tokens = np.arange(300)
    hashes = spec.hashes(tokens)
    whole = plan_prompt_admission(spec, spec.hashes(tokens), 0)
    wanted_states = {ref.position for ref in whole.objects if ref.kind is ObjectKind.STATE} - {299}
    assert wanted_states == {288, 256, 192, 64}
    # Step 1 computes [0, 200) and vLLM commits a state at every block boundary it passed.
    first = plan_step_admission(spec, hashes, 300, 0, (0, 200), offered_states=[32, 64, 96, 128, 160, 192])
    assert _planned(first) == [("KV", p) for p in range(32, 193, 32)] + [("STATE", 64), ("STATE", 192)]
    # Step 2 computes [200, 300); vLLM keeps the prompt's last hash boundary below L-1 (296), not 299.
    second = plan_step_admission(spec, hashes, 300, 0, (200, 300), offered_states=[224, 256, 288, 296])
    assert _planned(second) == [("KV", 224), ("KV", 256), ("KV", 288), ("STATE", 256), ("STATE", 288),
                                ("STATE", 296), ("TAIL", 296)]
    # Nothing already present is planned again, and an attention-only model keeps no states.
    assert plan_step_admission(spec, hashes, 300, 0, (200, 300), [224, 256, 296],
                               present={ref.key for ref in second.objects}).objects == ()
    attention = CacheSpec(ATTENTION, N, U)
    assert _planned(plan_step_admission(attention, attention.hashes(tokens), 300, 0, (0, 64), [32, 64])) == \
        [("KV", 32), ("KV", 64)]
