"""Identical outputs across arms: greedy decoding, every request's generated token ids and their log probabilities
(`answer`; runs stored before the replay asked for logprobs compare by tokens) compared with the reference arm's
(vLLM alone) in the same round. Where two arms compute a request the same way they must agree; a request whose
prompt was cut at another position (a different hit length: the engine computes the rest in other steps, and a
recurrent state summed in other chunks may round differently in bf16) may legitimately differ. Each mismatch is
reported with the request, the first differing position and both hit lengths, and classified by that cause.

With equal hit lengths the computation can still be split differently: in an open-loop replay a long prompt's
prefill spans several steps of --max-num-batched-tokens, and where each step cuts it depends on which other requests
share the step (their arrival, to the millisecond). vLLM alone itself then answers such a request differently from
one run to the next. A same-hit mismatch on a request whose reference runs (vLLM alone's, every round) disagree among
themselves is classified as that.

A stored prefix carries its history too. A later turn of a conversation resumes from the state an earlier turn
left, and that state's low bits depend on the steps the earlier turn was computed in, which start at the earlier
turn's hit. So a same-hit mismatch where an earlier turn of the same conversation hit at another length than in the
reference run (its outputs may still agree) resumes from other bytes, legitimately: the sequential replay
(serve_trace.py --sequential) showed exactly this in the two-engine arm, the same requests in both its rounds. Only a
same-hit mismatch with neither cause is reported as unexplained.

And a request shares its steps with the others in flight: when one of them hit at another length in this arm than
in the reference, it needs other prefill tokens, the step budget is cut elsewhere, and the request's own prefill is
split at other positions. vLLM alone shows it against itself: in the saturated replay (every request sent at once,
docs/runs/serve_trace-saturated-2026-11-27-6d63f4c) vLLM alone given more memory answered 5 requests with the same
hit length differently from vLLM alone, the same 5 in all three rounds, with no tiercache involved. A same-hit
mismatch on a request that overlapped, in either run, a request whose hit differs is classified as that; it needs
each request's send time (`sent_s`; a saturated replay sends all at 0), so a report without it names no such cause.
The sequential replay, where no steps are shared, is the run mode for output claims, and its check is another: each
request against a reference vLLM resuming at exactly the run's own hit (exact.py), where no cause is left to name.
This module describes the open-loop runs' outputs; it gives no verdict on tiercache's bytes.

Last, the arms without tiercache (vLLM alone with either memory, restarted, two of them) answer the same slice many
times over, and a request whose step split follows the batch shows it there: a same-hit mismatch whose very answer one
of those runs also gave at that hit length, or a request those runs answered in more than one way at that hit length,
is put down to the engine. (In the published open-loop rounds every request left unexplained before was one such:
docs/runs/serve_trace-round4-2026-11-27-189fba5.)
"""

from __future__ import annotations

import functools
from typing import Callable

DIFFERENT_HIT = "different hit length"
BATCHING = "same hit length: vLLM alone's own runs differ on it (the step split follows the batch)"
EARLIER_TURN = "same hit length: an earlier turn of its conversation hit at another length (its prefix was computed " \
    "in other steps)"
SHARED_STEPS = "same hit length: a request in flight beside it hit at another length (their steps were split " \
    "elsewhere)"
ANSWERED_SO = "same hit length: vLLM without tiercache gave this very answer at this hit length in another run"
ENGINE_VARIES = "same hit length: vLLM without tiercache answered it in more than one way at this hit length"
UNEXPLAINED = "same hit length: unexplained"
# The arms in which tiercache takes no part (serve_trace's and chat_rounds'): what the engine alone answers.
WITHOUT_TIERCACHE = frozenset({"alone", "alone-equal", "alone-restart", "two-alone", "two-alone-conv",
                               "noreuse-alone", "noreuse-alone-equal"})


def compare_outputs(runs: list[dict], reference: str = "alone", saturated: bool = False) -> dict:
    """Per arm: requests compared, identical, and every mismatch with its cause. `runs`: the report's runs (arm,
    round, result); each arm's run is compared with the reference arm's run of the same round, else its first.
    `saturated`: every request was sent at once (outcomes written without their send time get 0)."""
    references = {run["round"]: run["result"] for run in runs
                  if run["arm"] == reference and "outcomes" in run["result"]}
    if not references:
        return {"reference": reference, "arms": {}, "note": f"no {reference} run to compare with"}
    first = references[min(references)]
    unstable = _unstable(references)
    engine = _engine_answers(runs)
    arms: dict[str, dict] = {}
    for run in runs:
        if run["arm"] == reference or "outcomes" not in run["result"] or run["arm"].startswith("noreuse-") \
                != reference.startswith("noreuse-"):
            continue
        base = references.get(run["round"], first)
        tally = arms.setdefault(run["arm"], {"compared": 0, "identical": 0, "mismatches": []})
        _compare(_timed(base["outcomes"], saturated), _timed(run["result"]["outcomes"], saturated), run["round"],
                 tally, unstable, functools.partial(_engine_cause, engine, run))
    for tally in arms.values():
        causes: dict[str, int] = {}
        for mismatch in tally["mismatches"]:
            causes[mismatch["cause"]] = causes.get(mismatch["cause"], 0) + 1
        tally["causes"] = causes
    return {"reference": reference, "arms": arms, "reference_runs": len(references),
            "reference_requests": len({o["index"] for result in references.values() for o in result["outcomes"]}),
            "reference_unstable": sorted(unstable)}


def _unstable(references: dict[int, dict]) -> set[int]:
    """Requests the reference arm answered differently in two of its runs."""
    answers: dict[int, set[tuple[int, ...]]] = {}
    for result in references.values():
        for outcome in result["outcomes"]:
            if outcome["ok"]:
                answers.setdefault(outcome["index"], set()).add(answer(outcome))
    return {index for index, seen in answers.items() if len(seen) > 1}


def _engine_answers(runs: list[dict]) -> dict[tuple, list[tuple[tuple, tuple]]]:
    """(nothing reused?, request, hit length) -> (run, answer) of every run of an arm without tiercache."""
    answers: dict[tuple, list[tuple[tuple, tuple]]] = {}
    for run in runs:
        if run["arm"] not in WITHOUT_TIERCACHE:
            continue
        for outcome in run["result"].get("outcomes", ()):
            if outcome["ok"]:
                key = (run["arm"].startswith("noreuse-"), outcome["index"], outcome.get("cached_tokens"))
                answers.setdefault(key, []).append(((run["arm"], run["round"]), answer(outcome)))
    return answers


def _engine_cause(engine: dict, run: dict, outcome: dict) -> str | None:
    """Whether the engine without tiercache, in runs other than this one, gave this answer or more than one."""
    key = (run["arm"].startswith("noreuse-"), outcome["index"], outcome.get("cached_tokens"))
    others = [answer for source, answer in engine.get(key, ()) if source != (run["arm"], run["round"])]
    if answer(outcome) in others:
        return ANSWERED_SO
    return ENGINE_VARIES if len(set(others)) > 1 else None


def _compare(base: list[dict], outcomes: list[dict], round_: int, tally: dict, unstable: set[int],
             engine_cause: Callable[[dict], str | None]) -> None:
    reference = {o["index"]: o for o in base if o["ok"]}
    hit_differs = {o["index"] for o in outcomes
                   if o["index"] in reference and o.get("cached_tokens") != reference[o["index"]].get("cached_tokens")}
    for outcome in outcomes:
        other = reference.get(outcome["index"])
        if other is None or not outcome["ok"]:
            continue
        tally["compared"] += 1
        mine, theirs = answer(outcome), answer(other)
        if mine == theirs:
            tally["identical"] += 1
            continue
        position = first_difference(mine, theirs)
        same_hit = outcome.get("cached_tokens") == other.get("cached_tokens")
        earlier = _earlier_turn_hit_differs(outcome, outcomes, hit_differs)
        beside = _beside_a_different_hit(outcome, outcomes, hit_differs) \
            or _beside_a_different_hit(other, base, hit_differs)
        cause = _cause(same_hit, outcome["index"] in unstable, earlier, beside)
        if cause == UNEXPLAINED:
            cause = engine_cause(outcome) or UNEXPLAINED
        tally["mismatches"].append({"round": round_, "request": outcome["index"], "first_difference": position,
                                    "hit_tokens": outcome.get("cached_tokens"),
                                    "reference_hit_tokens": other.get("cached_tokens"), "cause": cause})


def answer(outcome: dict) -> tuple:
    """What a request answered, position by position: (token, its log probability). Runs that asked for no logprobs
    (those stored before the replay asked for them) compare by tokens alone. The same tokens with other logprobs are
    another answer: greedy decoding picks the same token from slightly wrong logits, so tokens alone can agree after
    a wrong restore."""
    logprobs = outcome.get("logprobs") or [None] * len(outcome["token_ids"])
    return tuple(zip(outcome["token_ids"], logprobs))


def first_difference(a, b) -> int:
    """The first position where two sequences differ (the shorter one's length where one is the other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _earlier_turn_hit_differs(outcome: dict, outcomes: list[dict], hit_differs: set[int]) -> bool:
    conversation = outcome.get("conversation")
    if conversation is None or conversation < 0:
        return False
    return any(o["index"] < outcome["index"] and o.get("conversation") == conversation and o["index"] in hit_differs
               for o in outcomes)


def _timed(outcomes: list[dict], saturated: bool) -> list[dict]:
    return [{**o, "sent_s": 0.0} if saturated and o.get("sent_s") is None else o for o in outcomes]


def _beside_a_different_hit(outcome: dict, outcomes: list[dict], hit_differs: set[int]) -> bool:
    """Whether a request whose hit differs was in flight while this one's prompt was computed (before its first
    token), in this run."""
    start = outcome.get("sent_s")
    if start is None:
        return False
    prefilled = start + outcome["ttft_s"]
    return any(o["index"] in hit_differs and o["index"] != outcome["index"] and o.get("sent_s") is not None
               and o["sent_s"] <= prefilled and o["sent_s"] + o["e2e_s"] >= start for o in outcomes)


def _cause(same_hit: bool, unstable: bool, earlier_turn: bool = False, beside: bool = False) -> str:
    if not same_hit:
        return DIFFERENT_HIT
    if unstable:
        return BATCHING
    if earlier_turn:
        return EARLIER_TURN
    return SHARED_STEPS if beside else UNEXPLAINED
