"""What a request saves (tiercache.prefix.admission), on hand-built cases (pure functions; the 'server' is a set of
keys)."""


from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tiercache.prefix.admission import plan_prompt_admission, plan_step_admission
from tiercache.prefix.objects import CacheSpec, ObjectKind

from tests.prefix.chains import ATTENTION, HYBRID, N, U, FakeCache, tokens


@pytest.fixture
def cache():
    return FakeCache(CacheSpec(HYBRID, N, U))


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
    assert boundary_states == [k * N for k in range(1, 10)]  # one at every boundary
    assert (ObjectKind.TAIL, 299) in kinds and (ObjectKind.STATE, 299) in kinds
    assert plan.state_positions == tuple(k * N for k in range(1, 10)) + (299,)
    capped = plan_prompt_admission(dataclasses.replace(cache.spec, max_boundary_states=2), hashes, 0)
    assert capped.state_positions == (256, 288, 299)  # the deepest ones


def _planned(plan) -> list[tuple[str, int]]:
    return sorted({(ref.kind.name, ref.position) for ref in plan.objects})


def test_step_admission_keeps_the_states_the_prompt_admission_wants():
    """An engine that keeps states where it chose (vLLM) offers them step by step; the shared rule admits the same
    boundary states as plan_prompt_admission (the deepest two here) and the prompt's end."""
    spec = CacheSpec(HYBRID, N, U, max_boundary_states=2)
    tokens = np.arange(300)
    hashes = spec.hashes(tokens)
    whole = plan_prompt_admission(spec, spec.hashes(tokens), 0)
    wanted_states = {ref.position for ref in whole.objects if ref.kind is ObjectKind.STATE} - {299}
    assert wanted_states == {288, 256}
    # Step 1 computes [0, 200) and vLLM commits a state at every block boundary it passed.
    first = plan_step_admission(spec, hashes, 300, 0, (0, 200), offered_states=[32, 64, 96, 128, 160, 192])
    assert _planned(first) == [("KV", p) for p in range(32, 193, 32)]
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

