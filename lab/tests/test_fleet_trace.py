"""The fleet benchmark runs (lab/fleet_trace.py, simulated engines, every policy) on a few requests of a
conversation trace and writes its report: structure only, and that the event-driven routers find hits. Which policy
hits more is a figure for docs/benchmarks.md, not an assertion."""

from __future__ import annotations

import json

import pytest

from lab.tests.commands import run_module

pytestmark = pytest.mark.slow


def conversations(path, count: int = 3, turns: int = 3) -> None:
    """`count` conversations of `turns` turns, each turn's hash ids extending the previous turn's (as in Mooncake's
    trace: a later turn repeats the earlier ones), interleaved."""
    rows = []
    for turn in range(turns):
        for c in range(count):
            ids = [0, 100 + c, *(1000 * c + k for k in range(2 * turn + 1))]
            rows.append({"timestamp": 400 * len(rows), "input_length": 512 * len(ids) - 100, "output_length": 20,
                         "hash_ids": ids})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_every_policy_replays_the_slice_and_reports(tmp_path):
    trace, out, png = tmp_path / "trace.jsonl", tmp_path / "fleet.json", tmp_path / "fleet.png"
    conversations(trace)
    result = run_module("lab.fleet_trace", "--trace", str(trace), "--max-requests", "9", "--conversations", "1",
                        "--pods", "2", "--host-mem", "64MiB", "--json", str(out), "--plot", str(png), "--no-progress",
                        timeout_s=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"round-robin", "attention", "restorable", "checkpoints"}
    assert report["slice"]["requests"] == 9 and report["slice"]["ideal_tokens"] > 0
    assert report["meta"]["commit"]  # the code it ran (lab.common.meta)
    for name, policy in report["policies"].items():
        assert policy["requests"] == 9 and sum(policy["requests_per_pod"].values()) == 9
        assert set(policy["requests_per_pod"]) == {"pod-0", "pod-1"}
        assert policy["ttft_ms"]["p50"] > 0 and policy["prompt_tokens"] == report["slice"]["prompt_tokens"]
        assert 0 <= policy["hit_tokens"] <= policy["prompt_tokens"]
        rows = report["rows"][name]
        assert len(rows["values"]) == 9 and "ttft_ms" in rows["columns"]
    assert report["policies"]["restorable"]["hit_tokens"] > 0
    assert report["policies"]["attention"]["hit_tokens"] > 0
    assert report["policies"]["checkpoints"]["hit_tokens"] > 0
    assert png.stat().st_size > 10_000
    assert "restorable" in result.stdout
