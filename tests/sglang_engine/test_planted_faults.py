"""Every gate shown to fail: faults planted in the reader engines of the session's scenarios (scenarios.py), one at a
time, each for one request (testkit/sglang_site/faults.py: the harness wraps TierCacheStorage's load calls in the engine
process; tiercache has no switch for it). The reader's caches are flushed first, so the judged request is restored from
storage again, with the fault; CAUGHT records which gate (gates.py) fails on which fault, dense and hybrid.

What the table shows:
- two KV pages swapped after a load: only the engine's bytes show it. Attention sums over the hit's pages in any
  order (each page's keys carry their position, rotated in before they were stored), and the restored pages are only
  attended to, never recomputed: 16 tokens' logprobs come out bit-identical.
- the state of the previous boundary: both gates (hybrid only: a dense model has no state).
- one bit flipped after the load's checksum was verified (the top mantissa bit of the largest value there): both
  gates in a KV page (dense and hybrid) and in a Mamba state (its largest value is in a conv window, which the next
  tokens read). In the recurrent state alone only the engine's bytes show it: this random-weight model's recurrent
  state is small next to its residual stream (largest value 7.5e-3), so no bf16 hidden state changes; measured, the
  sign bit and the exponent's lowest bit flipped there leave the outputs bit-identical too, only the exponent's top
  bit shows in them.
- a hit one token longer than loaded (its last token's KV left as a fresh pool holds it, zeros): both gates.
A fault with no place in a model (a state in a dense one) does not fire, and both gates pass: planting is harmless.
"""

from __future__ import annotations

import pytest

from tests.sglang_engine.gates import ENGINE_BYTES, OUTPUTS, assert_exact, gate_failures

BOTH = {OUTPUTS, ENGINE_BYTES}
# fault -> {model: the gates that fail on it; None: it has no place in that model}
CAUGHT = {
    "swapped_pages": {"dense": {ENGINE_BYTES}, "hybrid": {ENGINE_BYTES}},
    "previous_state": {"dense": None, "hybrid": BOTH},
    "flipped_bit_kv": {"dense": BOTH, "hybrid": BOTH},
    "flipped_bit_state": {"dense": None, "hybrid": BOTH},
    "flipped_bit_recurrent": {"dense": None, "hybrid": {ENGINE_BYTES}},
    "longer_hit": {"dense": BOTH, "hybrid": BOTH},
}

# The first test to ask for a scenario builds it (scenarios.py: two pairs of engine starts, up to 300 s each, and a
# dozen requests): more than the suite's 300 s per test on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


def scenario_of(request, kind: str):
    return request.getfixturevalue(f"{kind}_scenario")


@pytest.mark.parametrize("fault", list(CAUGHT))
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_each_gate_fails_on_the_faults_it_is_meant_to_catch(request, kind, fault):
    scenario = scenario_of(request, kind)
    reader = scenario.reader
    reader.flush()  # its device and host caches emptied: the request is restored from storage again
    reader.plant(fault)
    got = scenario.request(reader)
    fired = reader.fired()
    assert (got.storage_backend, got.storage) == ("TierCacheStorage", scenario.hit_tokens), got.details
    expected = CAUGHT[fault][kind]
    if expected is None:
        assert fired == [], f"{fault} fired in a {kind} model"
        assert_exact(got, scenario.tiercache.own, f"a {kind} restore with {fault} planted but not fired")
        return
    assert fired == [fault], f"{fault} was planted, {fired} fired"
    failures = gate_failures(got, scenario.tiercache.own)
    caught = {gate for gate, found in failures.items() if found}
    assert caught == expected, f"{fault} in the {kind} restore: caught by {sorted(caught)}, not {sorted(expected)} " \
                               f"({failures})"


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_reader_restores_exactly_again_without_a_fault(request, kind):
    """After the faults (their requests backed up what they computed from wrong bytes, past the hit), a restore
    with none planted meets both gates again: the faults never reached the pages a hit reads."""
    scenario = scenario_of(request, kind)
    scenario.reader.flush()
    got = scenario.request(scenario.reader)
    assert scenario.reader.fired() == []
    assert (got.storage_backend, got.storage) == ("TierCacheStorage", scenario.hit_tokens), got.details
    assert_exact(got, scenario.tiercache.own, f"the {kind} restore after the planted faults")
