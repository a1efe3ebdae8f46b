"""The lab's two serving benchmarks still run end to end, each a smoke run with real OpenAI-compatible vLLM servers
and a real tiercache server: `python -m lab.serve_trace` (vLLM alone and tiercache across a restart, a few requests
of the real trace, streamed completions; vLLM's offloading with its fs tier and with tiercache as its tier) and
`python -m lab.chat_rounds` (2 users, 3 rounds, tiny prompts, the same two arms: a closed loop whose prompts carry
the model's replies). Their figures go to the notes. And the sequential run's exact replay (lab/serving/exact.py),
on vLLM alone and on tiercache with faults planted in its loads. tiercache's arm without a restart is left out: the
restart arm runs its setup before the restart (what tiercache serves, its counters, its outputs compared), and each
vLLM server a smoke starts costs a minute of CI; the comparison table's ratios are held on made-up runs
(lab/tests/test_serve_report.py).

They share one module so that pytest-xdist workers (one module each at a time) never run two at once: each starts a
vLLM server and cache servers of its own, and two together beside another worker's engines once used all of a
24 GiB machine's memory (`make lab-smoke` runs them one after another). Their cache servers' host tiers are 256 MiB
(committed at start; these slices need a few MiB), not the lab's documented 2 GiB."""

from __future__ import annotations

import json

import pytest

from lab.chat import loop
from lab.tests.commands import run_module
from testkit import mooncake_trace

TRACE = mooncake_trace.CONVERSATION_SLICE  # its first 6 rows are the trace's


@pytest.mark.slow
@pytest.mark.timeout(1200)  # engines started in a subprocess, on a loaded machine too: its own limit decides
def test_serve_trace_alone_and_across_a_restart_on_a_few_requests(tmp_path):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "plot.png"
    command = ["lab.serve_trace", "--arms", "alone,restart",
               "--trace", str(TRACE),
               "--max-requests", "6", "--conversations", "1", "--time-scale", "0.02", "--max-input-tokens", "1024",
               "--max-output-tokens", "4", "--host-mib", "256", "--work-dir", str(tmp_path / "work"),
               "--json", str(report_path),
               "--plot", str(plot_path), "--no-progress"]
    result = run_module(*command, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report["arms"]) == {"alone", "restart"}
    # One round, its arms in a random order, each run's place in it and its provenance recorded.
    assert sorted((run["arm"], run["round"], run["position"]) for run in report["runs"])[0][:2] == ("alone", 0)
    assert sorted(run["position"] for run in report["runs"]) == [0, 1]
    assert {run["arm"] for run in report["runs"]} == {"alone", "restart"}
    for run in report["runs"]:
        assert len(run["provenance"]["commit"]) == 40 and run["provenance"]["load"]["loadavg_1m"]["samples"] >= 1
    # Every served engine ran with the test kit's copy-on-write fix (engines.py refuses one that did not).
    assert "copy-on-write" in report["meta"]["engine"]
    spec = mooncake_trace.SliceSpec(max_requests=6, time_scale=0.02, max_input_tokens=1024, max_output_tokens=4)
    expected = mooncake_trace.load(TRACE, spec)
    for run in report["runs"]:
        name, arm = run["arm"], run["result"]
        assert arm["requests"] == 6 and arm["errors"] == 0, (name, arm.get("error_kinds"))
        assert arm["ttft_ms"]["p50"] > 0 and arm["e2e_ms"]["p90"] >= arm["ttft_ms"]["p50"] > 0
        assert arm["prompt_tokens"] == report["params"]["slice_prompt_tokens"] > 0
        assert 0 <= arm["hit_tokens"] <= arm["prompt_tokens"]
        # Every request streamed the tokens it asked for (the trace's output length, at most 4 here), and the ids.
        assert [o["output_tokens"] for o in arm["outcomes"]] == [r.max_tokens for r in expected]
        assert [len(o["token_ids"]) for o in arm["outcomes"]] == [r.max_tokens for r in expected]
        assert [len(o["logprobs"]) for o in arm["outcomes"]] == [r.max_tokens for r in expected]  # one per token
        assert all(lp <= 0 for o in arm["outcomes"] for lp in o["logprobs"])
        assert all(o["cached_tokens"] is not None for o in arm["outcomes"])
    # Every request of the trace's first seconds shares its first block: vLLM's own cache serves those hits.
    assert report["arms"]["alone"]["hits"]["vllm_prefix_cache"] > 0
    restart = report["arms"]["restart"]
    assert restart["hits"]["tiercache_failed_loads"] == 0
    assert restart["hits"]["tiercache_delivered"] <= restart["hits"]["connector_promised"]
    assert set(restart["phases"]) == {"before", "after"}
    # After the restart the engine's own cache is empty: what it did not compute came from tiercache.
    assert restart["phases"]["after"]["hits"]["tiercache_delivered"] > 0
    # Send times place the requests in flight together (the output check's shared steps): the restart's second phase
    # is sent after the first one's last answer.
    assert all(o["sent_s"] is not None and o["sent_s"] >= 0
               for run in report["runs"] for o in run["result"]["outcomes"])
    restarted = restart_run(report)
    first = [o for o in restarted["outcomes"] if o["index"] < restarted["restart_at"]]
    later = [o for o in restarted["outcomes"] if o["index"] >= restarted["restart_at"]]
    assert max(o["sent_s"] + o["e2e_s"] for o in first) <= min(o["sent_s"] for o in later)
    assert report["outputs"]["arms"]["restart"]["compared"] == 6  # both phases, by their slice positions
    assert plot_path.stat().st_size > 10_000
    assert "alone" in result.stdout and "restart" in result.stdout  # the table (its ratios: test_serve_report.py)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four engines started in a subprocess, on a loaded machine too: its own limit decides
def test_serve_trace_offloading_arms_resume_after_a_restart_from_vllms_fs_tier_and_from_tiercache(tmp_path):
    """The arms with vLLM's own offloading (lab/serving/offloading.py), its worker stood in: a restart half-way
    with vLLM's fs tier, and with tiercache as the secondary tier. After the restart the new engine's pool is empty:
    what vLLM counted as cached from the disk (fs) or from an external tier (tiercache) came from the tier."""
    report_path = tmp_path / "report.json"
    command = ["lab.serve_trace",
               "--arms", "offload-fs-restart,offload-tiercache-restart", "--trace", str(TRACE),
               "--max-requests", "6", "--conversations", "1", "--time-scale", "0.02", "--max-input-tokens", "1024",
               "--max-output-tokens", "4", "--host-mib", "128", "--work-dir", str(tmp_path / "work"),
               "--json", str(report_path), "--no-progress"]
    result = run_module(*command, timeout_s=1100)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    for run in report["runs"]:
        assert run["result"]["errors"] == 0, (run["arm"], run["result"].get("error_kinds"))
    offload = report["offload"]
    assert set(offload) == {"offload-fs-restart", "offload-tiercache-restart"}
    assert offload["offload-fs-restart"]["after"]["hit_tokens_by_source"].get("disk", 0) > 0
    assert offload["offload-tiercache-restart"]["after"]["hit_tokens_by_source"].get("external_unspecified", 0) > 0
    for arm in offload.values():
        assert arm["all"]["failed_jobs"] == 0
        assert all(rate > 0 for rate in arm["all"]["tier_write_gb_s"].values()) and arm["all"]["tier_write_gb_s"]
    assert not list((tmp_path / "work").glob("fs-*")), "an fs tier's directory outlived its run"
    assert "vLLM's offloading" in result.stdout


def restart_run(report: dict) -> dict:
    return next(run["result"] for run in report["runs"] if run["arm"] == "restart")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # four engines started in a subprocess, on a loaded machine too: its own limit decides
def test_exact_replay_finds_vllm_alone_exact_and_flags_exactly_the_planted_restores(tmp_path):
    """The sequential run's exact replay (lab/serving/exact.py) on 40 requests of the trace, vLLM's KV cache
    small enough (4 MiB) that later turns come back through tiercache. vLLM alone (given the memory) against the
    reference: every request identical, tokens and logprobs, at its own hit (the reference is exact). tiercache with
    a state from an earlier position planted in half its requests' loads: each planted request wrong, every other
    request identical or labelled as reusing a planted request's blocks; none wrong otherwise."""
    report_path = tmp_path / "report.json"
    command = ["lab.serve_trace", "--sequential",
               "--arms", "alone-equal,tiercache", "--trace", str(TRACE), "--max-requests", "40",
               "--conversations", "1", "--max-input-tokens", "1024", "--max-output-tokens", "8", "--kv-cache-mib", "4",
               "--host-mib", "256", "--plant-fault", "previous_state", "--plant-one-in", "2",
               "--work-dir", str(tmp_path / "work"), "--json", str(report_path), "--no-progress"]
    result = run_module(*command, timeout_s=1400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    checks = {run["arm"]: run["result"]["exact"] for run in report["runs"]}
    alone = checks["alone-equal"]
    assert alone["compared"] == alone["identical"] == 40 and not alone["unchecked"] and not alone["planted"]
    tiercache = checks["tiercache"]
    assert not tiercache["unchecked"] and tiercache["compared"] == 40
    assert tiercache["planted"], "no fault went into a load: nothing was shown"
    assert [w["request"] for w in tiercache["planted_wrong"]] == tiercache["planted"]
    assert tiercache["planted_missed"] == [] and tiercache["wrong"] == []
    assert tiercache["identical"] == 40 - len(tiercache["planted"]) - len(tiercache["dependants_wrong"])
    assert "exact replay" in result.stdout

@pytest.mark.slow
@pytest.mark.timeout(900)  # engines started in a subprocess, on a loaded machine too: its own limit decides
def test_chat_rounds_alone_and_across_a_restart_two_users_three_rounds(tmp_path):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "plot.png"
    command = ["lab.chat_rounds", "--arms", "alone,restart",
               "--users", "2", "--rounds", "3", "--system-tokens", "256", "--context-tokens", "300",
               "--question-tokens", "32", "--answer-tokens", "8", "--gap-s", "0.2", "--stagger-s", "0.1",
               "--host-mib", "256",
               "--work-dir", str(tmp_path / "work"), "--json", str(report_path), "--plot", str(plot_path),
               "--no-progress"]
    result = run_module(*command, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    params = report["params"]
    spec = loop.ChatSpec(**{name: params[name] for name in ("users", "rounds", "system_tokens", "context_tokens",
                                                            "question_tokens", "answer_tokens", "vocab")})
    assert sorted((run["arm"], run["round"]) for run in report["runs"]) == [("alone", 0), ("restart", 0)]
    assert sorted(run["position"] for run in report["runs"]) == [0, 1]  # the round's order, recorded
    for run in report["runs"]:
        name, arm = run["arm"], run["result"]
        assert arm["requests"] == 6 and arm["errors"] == 0, (name, arm.get("error_kinds"))
        assert [len(o["token_ids"]) for o in arm["outcomes"]] == [8] * 6
        assert [o["index"] for o in arm["outcomes"]] == list(range(6))  # round * users + user, phases joined
        assert all(o["cached_tokens"] is not None for o in arm["outcomes"])
        # Each round's prompt is the previous prompt, the reply the server streamed, and a new question.
        records = {(r["user"], r["round"]): r for r in arm["chat"]}
        for user in range(2):
            replies = [arm["outcomes"][round_ * 2 + user]["token_ids"] for round_ in range(3)]
            for round_ in range(3):
                prompt = loop.build_prompt(spec, user, replies[:round_])
                assert records[user, round_]["prompt_hash"] == loop.prompt_hash(prompt), (name, user, round_)
                assert records[user, round_]["prompt_tokens"] == len(prompt) == 588 + 40 * round_
        assert arm["prompt_tokens"] == sum(r["prompt_tokens"] for r in arm["chat"])
    restart = report["arms"]["restart"]
    assert restart["hits"]["tiercache_failed_loads"] == 0
    restarted = next(run["result"] for run in report["runs"] if run["arm"] == "restart")
    assert set(restart["phases"]) == {"before", "after"} and restarted["restart_at"] == 2
    # After the restart the engine's own cache is empty: round 1's hits came through tiercache.
    assert restart["phases"]["after"]["hits"]["tiercache_delivered"] > 0
    assert report["outputs"]["arms"]["restart"]["compared"] == 6
    assert set(report["rounds"]["alone"]) == set(report["rounds"]["restart"]) == {"0", "1", "2"}
    assert plot_path.stat().st_size > 10_000
    assert "ratios per round" in result.stdout and "first differing (user, round)" in result.stdout
