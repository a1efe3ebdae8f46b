"""Identical outputs across arms: greedy decoding, every request's generated token ids compared with the reference
arm's (vLLM alone) in the same round. Where two arms compute a request the same way they must agree; a request whose
prompt was cut at another position (a different hit length: the engine computes the rest in other steps, and a
recurrent state summed in other chunks may round differently in bf16) may legitimately differ. Each mismatch is
reported with the request, the first differing position and both hit lengths, and classified by that cause; one with
equal hit lengths has no cause this benchmark knows of, and is reported as unexplained.
"""

from __future__ import annotations

DIFFERENT_HIT = "different hit length"
UNEXPLAINED = "same hit length: unexplained"


def compare_outputs(runs: list[dict], reference: str = "alone") -> dict:
    """Per arm: requests compared, identical, and every mismatch with its cause. `runs`: the report's runs (arm,
    round, result); each arm's run is compared with the reference arm's run of the same round, else its first."""
    references = {run["round"]: run["result"] for run in runs
                  if run["arm"] == reference and "outcomes" in run["result"]}
    if not references:
        return {"reference": reference, "arms": {}, "note": f"no {reference} run to compare with"}
    first = references[min(references)]
    arms: dict[str, dict] = {}
    for run in runs:
        if run["arm"] == reference or "outcomes" not in run["result"] or run["arm"].startswith("noreuse-") \
                != reference.startswith("noreuse-"):
            continue
        base = references.get(run["round"], first)
        tally = arms.setdefault(run["arm"], {"compared": 0, "identical": 0, "mismatches": []})
        _compare(base["outcomes"], run["result"]["outcomes"], run["round"], tally)
    for tally in arms.values():
        causes: dict[str, int] = {}
        for mismatch in tally["mismatches"]:
            causes[mismatch["cause"]] = causes.get(mismatch["cause"], 0) + 1
        tally["causes"] = causes
    return {"reference": reference, "arms": arms}


def _compare(base: list[dict], outcomes: list[dict], round_: int, tally: dict) -> None:
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
                                    "cause": UNEXPLAINED if same_hit else DIFFERENT_HIT})
