"""The open-loop runs' outputs described: greedy decoding, every request's generated token ids and log probabilities
(`answer`; runs stored before the replay asked for logprobs compare by tokens) against the reference arm's (vLLM
alone) in the same round, each mismatch reported with the request, the first differing position, both hit lengths,
and the likely cause. It gives no verdict on tiercache's bytes: that is the sequential replay's exact check
(exact.py), where a request's own hit is all that decides how its prompt is split into steps.

The causes, each a way two runs legitimately compute a request differently (a recurrent state summed in other
chunks may round differently in bf16):
- another hit length: the engine computes the rest of the prompt in other steps;
- the reference against itself: in an open-loop replay a long prefill spans several steps of
  --max-num-batched-tokens, cut where other arrivals fall, so vLLM alone's own runs of the request disagree;
- an earlier turn of the same conversation hit at another length: the later turn resumes from a state whose low
  bits came from other steps (the two-engine arm of serve_trace-sequential-2026-11-27-764bdfe shows it);
- a request in flight beside it hit at another length, so the shared step budget cut this prefill elsewhere (needs
  each request's send time, `sent_s`; serve_trace-saturated-2026-11-27-6d63f4c shows vLLM alone against itself);
- the engine: the arms without tiercache gave that very answer, or several answers, at that hit length.
A same-hit mismatch with none of these is reported as unexplained.
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
