"""Identical outputs across arms: greedy decoding, every request's generated token ids compared with the reference
arm's (vLLM alone) in the same round. Where two arms compute a request the same way they must agree; a request whose
prompt was cut at another position (a different hit length: the engine computes the rest in other steps, and a
recurrent state summed in other chunks may round differently in bf16) may legitimately differ. Each mismatch is
reported with the request, the first differing position and both hit lengths, and classified by that cause.

With equal hit lengths the computation can still be split differently: in an open-loop replay a long prompt's
prefill spans several steps of --max-num-batched-tokens, and where each step cuts it depends on which other requests
share the step (their arrival, to the millisecond). vLLM alone itself then answers such a request differently from
one run to the next. A same-hit mismatch on a request whose reference runs (vLLM alone's, every round) disagree among
themselves is classified as that; one on a request vLLM alone always answers alike has no cause this benchmark knows
of, and is reported as unexplained.
"""

from __future__ import annotations

DIFFERENT_HIT = "different hit length"
BATCHING = "same hit length: vLLM alone's own runs differ on it (the step split follows the batch)"
UNEXPLAINED = "same hit length: unexplained"


def compare_outputs(runs: list[dict], reference: str = "alone") -> dict:
    """Per arm: requests compared, identical, and every mismatch with its cause. `runs`: the report's runs (arm,
    round, result); each arm's run is compared with the reference arm's run of the same round, else its first."""
    references = {run["round"]: run["result"] for run in runs
                  if run["arm"] == reference and "outcomes" in run["result"]}
    if not references:
        return {"reference": reference, "arms": {}, "note": f"no {reference} run to compare with"}
    first = references[min(references)]
    unstable = _unstable(references)
    arms: dict[str, dict] = {}
    for run in runs:
        if run["arm"] == reference or "outcomes" not in run["result"] or run["arm"].startswith("noreuse-") \
                != reference.startswith("noreuse-"):
            continue
        base = references.get(run["round"], first)
        tally = arms.setdefault(run["arm"], {"compared": 0, "identical": 0, "mismatches": []})
        _compare(base["outcomes"], run["result"]["outcomes"], run["round"], tally, unstable)
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
                answers.setdefault(outcome["index"], set()).add(tuple(outcome["token_ids"]))
    return {index for index, seen in answers.items() if len(seen) > 1}


def _compare(base: list[dict], outcomes: list[dict], round_: int, tally: dict, unstable: set[int]) -> None:
    reference = {o["index"]: o for o in base if o["ok"]}
    for outcome in outcomes:
        other = reference.get(outcome["index"])
        if other is None or not outcome["ok"]:
            continue
        tally["compared"] += 1
        if outcome["token_ids"] == other["token_ids"]:
            tally["identical"] += 1
            continue
        position = next((i for i, (a, b) in enumerate(zip(outcome["token_ids"], other["token_ids"])) if a != b),
                        min(len(outcome["token_ids"]), len(other["token_ids"])))
        same_hit = outcome.get("cached_tokens") == other.get("cached_tokens")
        tally["mismatches"].append({"round": round_, "request": outcome["index"], "first_difference": position,
                                    "hit_tokens": outcome.get("cached_tokens"),
                                    "reference_hit_tokens": other.get("cached_tokens"),
                                    "cause": _cause(same_hit, outcome["index"] in unstable)})


def _cause(same_hit: bool, unstable: bool) -> str:
    if not same_hit:
        return DIFFERENT_HIT
    return BATCHING if unstable else UNEXPLAINED
