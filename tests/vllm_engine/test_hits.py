"""Hits on the real engine match vLLM's own, bit for bit, for two model shapes (N = 256 and N = 128 on a
CPU with AVX-512 BF16; 128 and 128 without it: testkit/vllm_models.py).

Three engines per model: `alone` is vLLM without the connector (the yardstick: its own prefix cache), `first` runs
with TierCacheConnector and fills tiercache, `fresh` is a second engine with the connector that has never seen the
prompts (the cross-instance and restart case: it can only hit through tiercache). vLLM's CPU engine is
deterministic, so where `fresh` resumes at the position where vLLM's own cache resumes, it must compute from the
same bytes (assert_same_bytes: every full block of the prefix and the state at the hit) and return the same outputs
(assert_same_computation: tokens, top-20 logprobs of 16 generated tokens and the prompt logprobs it computed, by
`==`).
"""

from __future__ import annotations

import pytest

from testkit.prompts import prompt
from testkit.vllm_engine import COMPARED_TOKENS
from tests.vllm_engine.gates import assert_finite, assert_same_bytes, assert_same_computation


@pytest.fixture(scope="module")
def trio(engines, cache_server):
    return (engines.start("alone", None), engines.start("first", cache_server.url),
            engines.start("fresh", cache_server.url), engines.n)


def test_repeated_prompts_below_and_above_n_hit_like_vllm_in_a_fresh_engine(trio):
    alone, first, fresh, n = trio
    for seed, length in enumerate([20, 100, n - 1, n + 1, n + 40, 3 * n + 5], start=100):
        tokens = prompt(seed, length)
        cold = alone.one(tokens)
        own_hit = alone.one(tokens)
        assert own_hit.cached == (length - 1) // 16 * 16, f"{length}: vLLM's own hit is {own_hit.cached}"
        # The connector does not change what the engine computes, and a fresh engine resumes where vLLM would.
        assert_same_computation(first.one(tokens), cold, f"first engine, {length} tokens")
        resumed = fresh.one(tokens)
        assert_same_bytes(resumed, own_hit, f"fresh engine, {length} tokens")
        assert_same_computation(resumed, own_hit, f"fresh engine, {length} tokens")


def test_a_fresh_engine_served_several_prompts_in_a_row_stays_finite(trio):
    """The reported failure: a fresh engine running 32, 100, 255 and 300 tokens (each stored by another engine)
    answered the last with token 0 and non-finite logits."""
    alone, first, fresh, n = trio
    lengths = [32, 100, 255, 300]
    prompts = [prompt(200 + i, length) for i, length in enumerate(lengths)]
    for tokens in prompts:
        first.one(tokens)
        alone.one(tokens)
    for tokens, length in zip(prompts, lengths):
        got = fresh.one(tokens)
        own = alone.one(tokens)
        assert got.cached == own.cached == (length - 1) // 16 * 16, f"{length} tokens: hit {got.cached}"
        assert_same_bytes(got, own, f"fresh engine, {length} tokens")
        assert_same_computation(got, own, f"fresh engine, {length} tokens")


def test_chat_turns_resume_at_the_previous_end_on_length_and_on_stop(trio):
    alone, first, fresh, n = trio
    system = prompt(300, n + 40)
    # Turn 1 ends on length with a reply longer than N, exactly at a block boundary (3N tokens computed), where
    # vLLM's own cache keeps a state too: the fresh engine's turn 2 must equal vLLM's own hit there.
    reply_tokens = 3 * n - len(system) + 1
    turn_one = first.one(system, max_tokens=reply_tokens)
    assert turn_one.finish == "length"
    assert_same_computation(turn_one, alone.one(system, max_tokens=reply_tokens), "turn 1")
    turn_two_prompt = system + turn_one.tokens + prompt(301, n + 20)
    own = alone.one(turn_two_prompt, max_tokens=COMPARED_TOKENS + 8)
    assert own.cached == 3 * n, f"vLLM's own hit for turn 2 is {own.cached}"
    # Turn 2 ends on a stop token, after 16 tokens or more: the first token from the 16th on that did not come before.
    stop_at = next((i for i in range(COMPARED_TOKENS - 1, len(own.tokens)) if own.tokens[i] not in own.tokens[:i]),
                   None)
    assert stop_at is not None, f"no new token from the 16th on to stop at: {own.tokens}"
    stop = own.tokens[stop_at]
    turn_two = fresh.one(turn_two_prompt, max_tokens=COMPARED_TOKENS + 8, stop_token_ids=[stop])
    assert turn_two.finish == "stop" and len(turn_two.tokens) == stop_at + 1
    assert_same_bytes(turn_two, own, "turn 2 in a fresh engine")
    assert_same_computation(turn_two, own.first(len(turn_two.tokens)), "turn 2 in a fresh engine")
    # Turn 2 ended on a stop token between blocks. Turn 3 adds a message longer than N and resumes exactly there
    # through tiercache (tail + state saved at the end of turn 2, found through the server's directory under the
    # block that holds it); vLLM alone can only go back to a block boundary.
    end_of_two = len(turn_two_prompt) + len(turn_two.tokens) - 1
    turn_three_prompt = turn_two_prompt + turn_two.tokens + prompt(302, n + n // 2 + 3)
    alone.one(turn_two_prompt, max_tokens=COMPARED_TOKENS + 8, stop_token_ids=[stop])
    vllm_alone = alone.one(turn_three_prompt)
    resumed = first.one(turn_three_prompt)
    assert resumed.cached == end_of_two > vllm_alone.cached
    # No yardstick resumes here: vLLM keeps no state at a turn's end between match units (turn 3's own hit below is).
    assert_finite(resumed, "turn 3")
    # The engine that just computed turn 3 now holds its own checkpoint at the prompt's last boundary; the fresh
    # engine resumes at the same position through tiercache and computes the same thing.
    own_three = first.one(turn_three_prompt)
    resumed_three = fresh.one(turn_three_prompt)
    assert_same_bytes(resumed_three, own_three, "turn 3 in the fresh engine")
    assert_same_computation(resumed_three, own_three, "turn 3 in the fresh engine")


def test_a_process_that_exits_right_after_a_turn_keeps_the_turns_end(engines, cache_server, trio):
    """With vLLM's engine core in the process (as here: an offline `LLM`), a request's end-of-request save reaches
    the worker with the next step, and a script that exits after its last request runs none: the connector's
    shutdown stores it. The next turn, in another engine, resumes at the reply's end, not the prompt's."""
    alone, _, fresh, n = trio
    system = prompt(500, n + 40)
    script = engines.start("exits", cache_server.url)
    reply = script.one(system, max_tokens=n // 2 + 3, settle=False).tokens
    script.close()  # the process exits; its connector's shutdown runs the pending save
    end_of_turn = len(system) + len(reply) - 1
    next_turn = system + reply + prompt(501, n + 7)
    resumed = fresh.one(next_turn)
    assert resumed.cached == end_of_turn, f"resumed at {resumed.cached}, the turn ended at {end_of_turn}"
    # No yardstick resumes here: vLLM keeps no state at a turn's end between match units (what this test is about).
    assert_finite(resumed, "the next turn")
    alone.one(system, max_tokens=n // 2 + 3)
    assert alone.one(next_turn, max_tokens=1).cached < end_of_turn  # vLLM alone goes back to a block boundary


def test_diverging_questions_after_one_system_prompt_hit_the_shared_blocks(trio):
    alone, first, fresh, n = trio
    system = prompt(400, 2 * n + 50)
    questions = [prompt(401 + i, 30 + 10 * i) for i in range(3)]
    first.one(system + questions[0])
    alone.one(system + questions[0])
    for i, question in enumerate(questions[1:], start=1):
        own = alone.one(system + question)
        assert own.cached == 2 * n, f"question {i}: vLLM's own hit is {own.cached}"
        resumed = fresh.one(system + question)
        assert_same_bytes(resumed, own, f"question {i} in a fresh engine")
        assert_same_computation(resumed, own, f"question {i} in a fresh engine")


@pytest.fixture(scope="module")
def readers(engines, cache_server):
    """Three engines with the settings docs/vllm.md recommends for documents that questions branch off: vLLM's align
    mode keeps a Mamba state only where a scheduler step ends, so steps of N tokens (--max-num-batched-tokens N) put
    one at every block boundary. `reader` has the connector (tiercache saves every one); `alone` is vLLM alone with
    the same settings, the yardstick: its own hit at a boundary uses a state computed the same way, in N-token steps;
    `fresh` has the connector and has never seen the document. All three run the same settings: whether a step size
    changes the computation depends on the CPU's kernels (a state computed in one long step gave logprobs 0.004 apart
    from one computed in N-token steps on one machine of this kind, 0.0 on another), and the gates ask for the same
    bits. In N-token steps a cold run is cut where a hit at a boundary resumes: it is a second yardstick here."""
    n = engines.n
    return (engines.start("reader", cache_server.url, max_num_batched_tokens=n),
            engines.start("alone-in-steps", None, max_num_batched_tokens=n),
            engines.start("fresh-in-steps", cache_server.url, max_num_batched_tokens=n))


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])
def test_questions_branching_inside_a_long_document_resume_within_n_of_the_branch(trio, readers, share):
    """Document + question A on the reader; question B branches at 10%..90% of the document on a fresh engine and
    resumes at the block boundary below its branch point, computing what vLLM alone computes from its own state
    there. vLLM alone reading the document in one step keeps no state there."""
    one_step, _, _, n = trio
    reader, alone, fresh = readers
    document = prompt(1100, 6 * n + 37)  # seeds no other test uses: the cache server is shared by the session
    question = prompt(1101, 40)
    for engine in (reader, alone, one_step):
        engine.one(document + question, max_tokens=1)
    shared = int(share * len(document))
    boundary = shared // n * n
    branch = document[:shared] + prompt(1102 + int(10 * share), 30)
    own = alone.one(branch)
    assert own.cached == boundary, f"vLLM's own hit is {own.cached}"
    resumed = fresh.one(branch)
    assert resumed.cached == boundary > shared - n, f"tiercache's hit is {resumed.cached}"
    what = f"a branch at {share:.0%} in a fresh engine"
    if boundary:
        assert_same_bytes(resumed, own, what)
    assert_same_computation(resumed, own, what)
    alone.reset_prefix_cache()
    assert_same_computation(resumed, alone.one(branch).from_position(boundary), f"{what}, against a cold run")
    if boundary:
        assert one_step.one(branch, max_tokens=1).cached < boundary  # what the recommended settings buy
