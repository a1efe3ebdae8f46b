"""Each exactness gate of the harness fails on the faults it is meant to catch (testkit/connector_faults.py
plants them in the connector's load path, one request at a time, so one engine serves them all).

The gates (tests/vllm_engine/gates.py): the engine bytes gate (assert_same_bytes: the hit, and the digests of every
full block of the prefix and of the state at the hit, per KV cache group) and the outputs gate
(assert_same_computation: the hit, the tokens, the top-20 logprobs of 16 generated tokens and the prompt logprobs the
engine computed, all by `==`). Each fault's prompt is restored by a `judged` engine with the connector that never saw
it, and compared with vLLM's own hit at the same position in `alone` (no connector). The prompt has 808 tokens: for
the hybrid (N = 256 with AVX-512 BF16: three kv chunks; 128 without: six) the hit is 800, the kv chunks, a tail and
the state at 800 (the server also holds the state at 784); for the dense model (N = 64; vLLM hits whole blocks; no
recurrent state, so the state faults do not apply) the hit is 768, 12 kv chunks.

The bytes gate must catch every fault (a hit one token longer through the position it reads the bytes at: the bytes
themselves are the right ones for 800). The outputs gate must catch those in OUTPUTS_CATCH. Measured on a 2-vCPU x86
machine with vLLM 0.32's CPU build, not asserted (whether a change that small reaches the logits is the kernels'
business, which is what the bytes gate is for): it missed the flipped bit (the lowest bit of one SSM state float),
and caught the swapped blocks only at the 7th generated token, where the top-20 set changed (tokens and prompt
logprobs were equal: attention sums over keys in any order; a swap measured earlier at 1,234 and 2,600 tokens left
all 16 generated tokens identical). `pytest -s` prints what each gate said.
"""

from __future__ import annotations

import pytest

from testkit.connector_faults import KINDS
from testkit.prompts import prompt
from tests.vllm_engine.gates import assert_same_bytes, assert_same_computation

PROMPT_TOKENS = 808  # hit 800
EARLIER = 16  # the earlier state the server holds sits this far below the hit
# Faults the outputs gate must see (the hit it reports, and the state it computes from).
OUTPUTS_CATCH = {"hit_one_longer", "previous_state"}
MODELS = {"four_layer": KINDS, "dense": ("swapped_blocks", "hit_one_longer")}  # engines fixture -> its faults
CASES = [(model, fault) for model, faults in MODELS.items() for fault in faults]


@pytest.fixture(scope="module")
def fault_engines(four_layer, dense, cache_server):
    """Of the model a test names (the engines fixture's name), started once for the module: `producer` stores the
    prompts in tiercache, `alone` (the yardstick) computes them the same way, `judged` restores them."""
    started = {}

    def of(model: str):
        if model not in started:
            engines = {"four_layer": four_layer, "dense": dense}[model]
            started[model] = (engines.start("faults-producer", cache_server.url), engines.start("faults-alone", None),
                              engines.start("faults-judged", cache_server.url), engines.unit)
        return started[model]

    return of


def _restore(fault_engines, seed: int, fault_kind: str | None):
    """The prompt of `seed` restored by the judged engine (with the fault planted), and vLLM's own hit there."""
    producer, alone, judged, unit = fault_engines
    tokens = prompt(seed, PROMPT_TOKENS)
    hit = (len(tokens) - 1) // unit * unit
    for engine in (producer, alone):  # the prompt computed cold by both: the state at the hit in one shape
        engine.one(tokens, max_tokens=1)
    # The server also gets the state at hit - EARLIER: the last boundary of a shorter prompt the producer runs after.
    producer.one(tokens[:hit - EARLIER + 1], max_tokens=1)
    own = alone.one(tokens)
    assert own.cached == hit, f"vLLM's own hit is {own.cached}"
    fault = None if fault_kind is None else {"kind": fault_kind, "position": hit - EARLIER}
    got = judged.one(tokens, fault=fault)
    # The fault went in as planted: the load succeeded (a failed load recomputes: no hit at all).
    assert got.cached == hit + (fault_kind == "hit_one_longer"), f"{fault_kind}: the judged engine hit {got.cached}"
    return got, own


@pytest.mark.parametrize("model", list(MODELS))
def test_without_a_fault_both_gates_pass(fault_engines, model):
    got, own = _restore(fault_engines(model), 3000, None)
    assert got.cached == own.cached
    assert_same_bytes(got, own, "no fault")
    assert_same_computation(got, own, "no fault")


@pytest.mark.parametrize("model, fault", CASES)
def test_each_gate_fails_on_the_faults_it_is_meant_to_catch(fault_engines, model, fault):
    got, own = _restore(fault_engines(model), 3001 + KINDS.index(fault), fault)
    caught = {}
    for gate, check in (("bytes", assert_same_bytes), ("outputs", assert_same_computation)):
        try:
            check(got, own, fault)
            caught[gate] = None
        except AssertionError as failure:
            caught[gate] = str(failure)
    # What differs, part by part (`pytest -s` shows it: the table in docs/vllm.md comes from here).
    parts = {"hit": got.cached == own.cached, "tokens": got.tokens == own.tokens,
             "logprobs": got.logprobs == own.logprobs, "prompt logprobs": got.prompt_logprobs == own.prompt_logprobs}
    print(f"\n{fault}: bytes gate: {caught['bytes'] or 'passed'}; outputs gate: {caught['outputs'] or 'passed'}; "
          f"differ: {[part for part, same in parts.items() if not same]}")
    assert caught["bytes"], f"the bytes gate missed {fault}"
    if fault in OUTPUTS_CATCH:
        assert caught["outputs"], f"the outputs gate missed {fault}"
