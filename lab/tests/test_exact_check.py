"""The exact replay's judgement (lab/serving/exact.py) on made-up answers: identical answers at the same hit
pass; any other answer is wrong unless a fault went into that request's load (planted) or the request reused a
planted request's blocks past the first position the fault made wrong (a dependant); a request the reference could
not resume at the run's hit is unchecked, never passed; a planted request answered right is counted as missed.
(On a real engine: lab/tests/vllm_engine/test_lab_smokes.py.)"""

from __future__ import annotations

from lab.serving.exact import by_arm, judge, read_planted, report_lines
from testkit.connector_faults import prompt_digest

# Two conversations sharing a 64-token system prompt: 0, 2, 3 continue one another; 1 is another conversation.
SYSTEM = list(range(64))
PROMPTS = {0: SYSTEM + [1] * 200, 1: SYSTEM + [2] * 300, 2: SYSTEM + [1] * 200 + [3] * 100,
           3: SYSTEM + [1] * 200 + [3] * 100 + [4] * 50}
HITS = {0: 64, 1: 64, 2: 256, 3: 352}


def _outcome(index: int, tokens=(5, 6), logprobs=(-0.5, -0.25), hit=None) -> dict:
    return {"index": index, "ok": True, "token_ids": list(tokens), "logprobs": list(logprobs),
            "cached_tokens": HITS[index] if hit is None else hit}


def _run(changed: dict | None = None) -> list[dict]:
    return [(changed or {}).get(i, _outcome(i)) for i in sorted(PROMPTS)]


def _planted(index: int, first_wrong: int, kind: str = "previous_state") -> dict:
    return {"digest": prompt_digest(PROMPTS[index]), "kind": kind, "first_wrong": first_wrong}


def test_identical_answers_at_the_same_hit_pass() -> None:
    tally = judge(_run(), _run(), [], PROMPTS)
    assert (tally["compared"], tally["identical"], tally["wrong"], tally["unchecked"]) == (4, 4, [], [])


def test_a_logprob_alone_that_differs_is_wrong() -> None:
    tally = judge(_run({2: _outcome(2, logprobs=(-0.5, -0.25000001))}), _run(), [], PROMPTS)
    assert [w["request"] for w in tally["wrong"]] == [2]
    assert tally["wrong"][0]["first_difference"] == 1


def test_a_hit_the_reference_did_not_reach_is_unchecked_not_passed() -> None:
    tally = judge(_run(), _run({3: _outcome(3, hit=256)}), [], PROMPTS)
    assert tally["compared"] == 3
    assert tally["unchecked"] == [{"request": 3, "hit_tokens": 352, "reference_hit_tokens": 256}]


def test_planted_requests_and_the_requests_that_reused_their_blocks() -> None:
    """A fault in request 2's state at 256: request 3 resumed at 352 from blocks 2 computed from that state, so it
    depends on 2; request 1 (another conversation) shares only the system prompt, below the first wrong position."""
    wrong = (9, 9)
    run = _run({2: _outcome(2, tokens=wrong), 3: _outcome(3, tokens=wrong), 1: _outcome(1, tokens=wrong)})
    tally = judge(run, _run(), [_planted(2, 256)], PROMPTS)
    assert tally["planted"] == [2]
    assert [w["request"] for w in tally["planted_wrong"]] == [2]
    assert [(w["request"], w["depends_on"]) for w in tally["dependants_wrong"]] == [(3, 2)]
    assert [w["request"] for w in tally["wrong"]] == [1]


def test_a_request_that_resumed_below_the_first_wrong_position_does_not_depend() -> None:
    """Request 3 resumed at 200, below the wrong state at 256 of request 2: it computed those positions itself."""
    run = _run({3: _outcome(3, tokens=(9, 9), hit=192)})
    tally = judge(run, _run({3: _outcome(3, hit=192)}), [_planted(2, 256)], PROMPTS)
    assert [w["request"] for w in tally["wrong"]] == [3]


def test_a_planted_request_answered_right_is_missed() -> None:
    tally = judge(_run(), _run(), [_planted(0, 64, "swapped_blocks")], PROMPTS)
    assert tally["planted_missed"] == [0]
    assert "1 missed" in report_lines([{"arm": "tiercache", "round": 0, "result": {"exact": tally}}])[-1]


def test_the_planted_log_and_the_arms_totals(tmp_path) -> None:
    log = tmp_path / "planted.tsv"
    log.write_text(f"{prompt_digest(PROMPTS[2])}\tswapped_blocks\t64\t2\tcmpl-7\n")
    assert read_planted(log) == [{"digest": prompt_digest(PROMPTS[2]), "kind": "swapped_blocks", "first_wrong": 64,
                                  "request": 2}]
    tally = judge(_run({2: _outcome(2, tokens=(9, 9))}), _run(), read_planted(log), PROMPTS)
    totals = by_arm([{"arm": "tiercache", "round": r, "result": {"exact": tally}} for r in (0, 1)])
    assert totals["tiercache"] == {"runs": 2, "compared": 8, "identical": 6, "unchecked": 0, "planted": 2,
                                   "planted_wrong": 2, "planted_missed": 0, "dependants_wrong": 0, "wrong": 0}


def test_two_requests_with_the_same_prompt_are_told_apart_by_the_name_the_lab_gave_them() -> None:
    """Prompts cut to the slice's length can repeat; the planted log names the request (the lab's index)."""
    prompts = {**PROMPTS, 4: PROMPTS[3]}
    hits = {**HITS, 4: 352}
    run = [{**_outcome(i if i < 4 else 3), "index": i, "cached_tokens": hits[i]} for i in sorted(prompts)]
    reference = [dict(o) for o in run]
    run[4] = {**run[4], "token_ids": [9, 9]}
    planted = [{**_planted(3, 352), "request": 4}]
    tally = judge(run, reference, planted, prompts)
    assert [w["request"] for w in tally["planted_wrong"]] == [4] and tally["planted_missed"] == []
