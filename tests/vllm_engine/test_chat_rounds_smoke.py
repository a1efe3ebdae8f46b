"""benchmarks/chat_rounds.py still runs end to end (a smoke run: 2 users, 3 rounds, tiny prompts, three arms): real
OpenAI-compatible vLLM servers, a real tiercache server, a closed loop whose prompts carry the model's replies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chat import loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # engines started in a subprocess, on a loaded machine too: its own limit decides
def test_three_arms_two_users_three_rounds(tmp_path):
    report_path, plot_path = tmp_path / "report.json", tmp_path / "plot.png"
    command = [sys.executable, str(ROOT / "benchmarks" / "chat_rounds.py"), "--arms", "alone,tiercache,restart",
               "--users", "2", "--rounds", "3", "--system-tokens", "256", "--context-tokens", "300",
               "--question-tokens", "32", "--answer-tokens", "8", "--gap-s", "0.2", "--stagger-s", "0.1",
               "--work-dir", str(tmp_path / "work"), "--json", str(report_path), "--plot", str(plot_path),
               "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    params = report["params"]
    spec = loop.ChatSpec(**{name: params[name] for name in ("users", "rounds", "system_tokens", "context_tokens",
                                                            "question_tokens", "answer_tokens", "vocab")})
    assert sorted((run["arm"], run["round"]) for run in report["runs"]) == [("alone", 0), ("restart", 0),
                                                                             ("tiercache", 0)]
    assert sorted(run["position"] for run in report["runs"]) == [0, 1, 2]  # the round's order, recorded
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
    assert report["arms"]["tiercache"]["hits"]["tiercache_failed_loads"] == 0
    restart = report["arms"]["restart"]
    restarted = next(run["result"] for run in report["runs"] if run["arm"] == "restart")
    assert set(restart["phases"]) == {"before", "after"} and restarted["restart_at"] == 2
    # After the restart the engine's own cache is empty: round 1's hits came through tiercache.
    assert restart["phases"]["after"]["hits"]["tiercache_delivered"] > 0
    outputs = report["outputs"]["arms"]
    assert outputs["tiercache"]["compared"] == outputs["restart"]["compared"] == 6
    assert set(report["rounds"]["tiercache"]) == set(report["rounds"]["restart"]) == {"0", "1", "2"}
    assert plot_path.stat().st_size > 10_000
    assert "tiercache / alone:" in result.stdout and "first differing (user, round)" in result.stdout
