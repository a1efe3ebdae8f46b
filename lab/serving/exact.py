"""The output check a wrong restore cannot pass: after a sequential run, a reference vLLM computes every request of it
again, one at a time in the run's order, resuming from its own prefix cache at exactly the length the run's engine
resumed at, and each answer (generated tokens and their logprobs) is compared with the run's by `==`.

Why exactly that length: a prompt computed from another hit is split into other steps, and a recurrent state summed
over other spans rounds differently in bf16, so "a different hit length" could explain any answer. Here no request
is computed differently from the run, only from other memory: the reference holds every block it computed (vLLM
alone with the equal-memory arm's KV cache, which keeps the whole slice), its hits held to the run's by the test kit
(testkit.hit_cap), and each request resumes from blocks and a state that the same earlier requests computed in the
same steps. So where the run's engine resumed from bytes tiercache restored, the reference resumed from vLLM's own
bytes for the same positions, computed the same way: a byte restored wrong shows as another answer. The reference
runs with the same copy-on-write fix as every served engine (engines.py), so its own partial-block hits are right.

One thing the reference cannot mirror: vLLM 0.32 cuts a prefill step at a "shared-prefix junction" where its
attention blocks reach further than the recurrent states it still holds (its Marconi-style checkpoint), so an engine
that evicted part of a conversation splits that conversation's next prompt where its leftovers end. The reference
holds everything and searches only up to the run's hit, so it sees no such junction and may split elsewhere: a
request whose run had one can differ from the reference with no byte restored wrong (a false alarm, never a missed
fault). It is the suspected cause of a difference with no tiercache involved, not yet shown
(docs/runs/serve_trace-exact-2026-11-28-669b44c, README: the request, and what is known of it).

A request whose hit the reference could not reach (it lacks the blocks or the state there) is not checked and is
counted apart. Faults planted in the run's connector (testkit.connector_faults.HashedFaults: which loads they went
into, and the first prompt position each made wrong) must come out as wrong answers: each planted request is
labelled so, and a later request reusing a planted request's blocks beyond that position (it shares that prompt and
resumed past it) as depending on it. Any other wrong answer is tiercache's (or the reference's) fault: `wrong`.
Shown in lab/tests/vllm_engine/test_lab_smokes.py (vLLM alone against the reference: nothing wrong; tiercache with
faults in half its requests: exactly those wrong), on made-up answers in lab/tests/test_exact_check.py, and on the
documented slice in docs/runs/serve_trace-exact-2026-11-28-669b44c.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from lab.serving.outputs import answer, first_difference
from testkit.connector_faults import NAMED, PLANTED_LINE, prompt_digest
from testkit.hit_cap import CAP, CAPPED_LINE


def reference_settings(bench):
    """The arm's engine settings with the equal-memory arm's KV cache, its hits capped per request."""
    return dataclasses.replace(bench.engine(), kv_cache_bytes=bench.equal_kv_bytes,
                               testkit={"TIERCACHE_HIT_CAP": "1"}, testkit_lines=(CAPPED_LINE,))


def fault_settings(bench, name: str) -> dict:
    """The test-kit settings that plant --plant-fault in an arm's connector, logging to the arm's planted file."""
    kind = getattr(bench.args, "plant_fault", None)
    if not kind:
        return {}
    return {"testkit": {"TIERCACHE_PLANT_FAULT": kind, "TIERCACHE_PLANT_ONE_IN": str(bench.args.plant_one_in),
                        "TIERCACHE_PLANTED_LOG": str(planted_log(bench, name))},
            "testkit_lines": (PLANTED_LINE,)}


def named(request) -> dict:
    """vLLM's extra arguments that name a request to the faults planted in its engine (the planted log then says
    which request each fault went into, even where two requests send the same prompt)."""
    return {NAMED: request.index}


def planted_log(bench, name: str) -> Path:
    return bench.work / f"{name}-planted.tsv"


def check_run(bench, name: str, result: dict) -> dict:
    """Replay the run's requests on a fresh reference engine and judge every answer (the run's `exact` entry)."""
    from lab.serving.engines import VllmServer
    from lab.serving.replay import replay

    outcomes = sorted((o for o in result.get("outcomes", ()) if o["ok"] and o.get("cached_tokens") is not None),
                      key=lambda o: o["index"])
    caps = {o["index"]: o["cached_tokens"] for o in outcomes}
    requests = [r for r in bench.requests if r.index in caps]
    log, planted = planted_log(bench, name), []
    if log.exists():
        planted = read_planted(log)
        log.rename(bench.work / f"{name}-planted-{time.time_ns()}.tsv")  # the next run's log starts empty
    engine = VllmServer(reference_settings(bench), bench.work / f"{name}-reference.log").start()
    try:
        mine, _ = asyncio.run(replay(requests, [engine.url], bench.model_dir, sequential=True,
                                     extra=lambda r: {CAP: caps[r.index]}))
    finally:
        engine.stop()
    reference = [dataclasses.asdict(o) for o in mine]
    return judge(outcomes, reference, planted, {r.index: r.prompt for r in requests})


def read_planted(path: Path) -> list[dict]:
    """The planted log's loads: prompt digest, fault, first wrong position, the request (its index; None where the
    client named none)."""
    loads = []
    for line in path.read_text().splitlines():
        digest, kind, first, request, *_ = line.split("\t") + ["?"]
        loads.append({"digest": digest, "kind": kind, "first_wrong": int(first),
                      "request": int(request) if request.isdigit() else None})
    return loads


def judge(outcomes: list[dict], reference: list[dict], planted: list[dict], prompts: dict[int, list[int]]) -> dict:
    """Every request of the run against the reference's answer at the same hit. `planted`: the loads faults went
    into (read_planted); `prompts`: each request's prompt, by index."""
    theirs = {o["index"]: o for o in reference}
    by_digest = {prompt_digest(prompts[i]): i for i in sorted(prompts, reverse=True)}  # the first of equal prompts
    sources = {}
    for load in planted:
        index = load.get("request") if load.get("request") is not None else by_digest.get(load["digest"])
        if index is not None:
            sources[index] = min(load["first_wrong"], sources.get(index, load["first_wrong"]))
    tally = {"compared": 0, "identical": 0, "unchecked": [], "planted": sorted(sources), "wrong": [],
             "planted_wrong": [], "dependants_wrong": [], "planted_missed": []}
    for outcome in outcomes:
        index = outcome["index"]
        other = theirs.get(index)
        if other is None or not other["ok"] or other.get("cached_tokens") != outcome["cached_tokens"]:
            tally["unchecked"].append({"request": index, "hit_tokens": outcome["cached_tokens"],
                                       "reference_hit_tokens": None if other is None else other.get("cached_tokens")})
            continue
        tally["compared"] += 1
        source = _depends_on(index, outcome["cached_tokens"], prompts, sources)
        if source is not None and index not in sources:
            sources[index] = sources[source]  # its own blocks from there on are wrong too
        mine, ref = answer(outcome), answer(other)
        if mine == ref:
            tally["identical"] += 1
            if index in tally["planted"]:
                tally["planted_missed"].append(index)
            continue
        # Both answers kept: a mismatch is looked into from the report.
        entry = {"request": index, "hit_tokens": outcome["cached_tokens"],
                 "first_difference": first_difference(mine, ref), "answer": mine, "reference_answer": ref}
        if index in tally["planted"]:
            tally["planted_wrong"].append(entry)
        elif source is not None:
            tally["dependants_wrong"].append({**entry, "depends_on": source})
        else:
            tally["wrong"].append(entry)
    return tally


def _depends_on(index: int, hit: int, prompts: dict[int, list[int]], sources: dict[int, int]) -> int | None:
    """The earliest earlier request with wrong blocks that this one resumed past: their prompts agree beyond the first
    wrong position and this request's hit goes beyond it too (it reused those blocks or a state computed from them)."""
    for source in sorted(sources):
        if source >= index:
            break
        first_wrong = sources[source]
        if min(first_difference(prompts[source], prompts[index]), hit) > first_wrong:
            return source
    return None


def summary_line(name: str, tally: dict) -> str:
    """One line of the report for an arm-run's exact check."""
    parts = [f"{tally['identical']} of {tally['compared']} identical at the run's own hit"]
    if tally["unchecked"]:
        parts.append(f"{len(tally['unchecked'])} not reached by the reference (unchecked)")
    if tally["planted"]:
        parts.append(f"{len(tally['planted'])} planted: {len(tally['planted_wrong'])} wrong, "
                     f"{len(tally['planted_missed'])} missed; {len(tally['dependants_wrong'])} wrong depending on them")
    parts.append(f"{len(tally['wrong'])} wrong")
    return f"  {name}: " + ", ".join(parts)


def by_arm(runs: list[dict]) -> dict:
    """Each arm's exact checks over its runs, added up (the report's `exact`; empty for runs that had none)."""
    arms: dict[str, dict] = {}
    for run in runs:
        tally = run["result"].get("exact")
        if tally is None:
            continue
        total = arms.setdefault(run["arm"], {"runs": 0, "compared": 0, "identical": 0, "unchecked": 0, "planted": 0,
                                             "planted_wrong": 0, "planted_missed": 0, "dependants_wrong": 0,
                                             "wrong": 0})
        total["runs"] += 1
        for key in total:
            if key != "runs":
                value = tally[key]
                total[key] += value if isinstance(value, int) else len(value)
    return arms


def report_lines(runs: list[dict]) -> list[str]:
    """The report's section: every run's exact check, one line each."""
    checked = [run for run in runs if "exact" in run["result"]]
    if not checked:
        return []
    lines = ["", "exact replay (each request of a sequential run against a reference vLLM resuming at the run's own "
             "hit; tokens and logprobs by ==; exact.py):"]
    for run in sorted(checked, key=lambda r: (r["arm"], r["round"])):
        lines.append(summary_line(f"{run['arm']} (round {run['round']})", run["result"]["exact"]))
    return lines
