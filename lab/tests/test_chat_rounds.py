"""The chat benchmark's pure parts (lab/chat): prompts that extend the last one with its reply and a new
question, per-round figures, and mismatches placed at (user, round). (The benchmark itself runs on vLLM:
lab/tests/vllm_engine/test_lab_smokes.py.)"""

from __future__ import annotations

from lab.chat import loop, report
from lab.serving.outputs import DIFFERENT_HIT

SPEC = loop.ChatSpec(users=2, rounds=3, system_tokens=20, context_tokens=30, question_tokens=5, answer_tokens=4,
                     vocab=50)


def test_a_round_extends_the_last_prompt_with_its_reply_and_a_question():
    first = [loop.first_prompt(SPEC, u) for u in range(2)]
    assert [len(p) for p in first] == [55, 55]
    assert first[0][:20] == first[1][:20] and first[0][20:50] != first[1][20:50]  # one system prompt, own contexts
    assert min(min(p) for p in first) >= 3 and max(max(p) for p in first) < 50
    assert loop.first_prompt(SPEC, 0) == first[0]  # seeded: the same in every process
    replies = [[7, 8, 9, 10], [11, 12, 13, 14]]
    second = loop.build_prompt(SPEC, 0, replies[:1])
    assert second[:55] == first[0] and second[55:59] == replies[0] and len(second) == 64
    third = loop.build_prompt(SPEC, 0, replies)
    assert third[:64] == second and third[64:68] == replies[1] and len(third) == SPEC.max_prompt_tokens == 73
    assert second[59:] != loop.build_prompt(SPEC, 1, replies[:1])[59:]  # questions seeded by user and round


def test_the_loop_builds_each_round_from_what_it_was_sent_and_answered():
    chat = loop.ChatLoop(SPEC)
    sent = chat.prompt(1, 0)
    chat.prompts[1], chat.replies[1] = sent, [[5, 6, 7, 8]]
    assert chat.prompt(1, 1) == loop.build_prompt(SPEC, 1, [[5, 6, 7, 8]])
    phase = chat.phase(1, 3)
    assert len(phase) == 4 and list(phase) == []


def outcome(index, ttft, cached, tokens=(1, 2)):
    return {"index": index, "ok": True, "ttft_s": ttft, "cached_tokens": cached, "token_ids": list(tokens)}


def result(outcomes, hashes, own=(0, 0, 0, 0)):
    return {"outcomes": outcomes, "chat": [{"index": i, "prompt_hash": h, "own_hits": o, "connector_hits": 1}
                                           for i, (h, o) in enumerate(zip(hashes, own))]}


def test_round_figures_group_requests_by_round():
    run = result([outcome(0, 0.1, 0), outcome(1, 0.3, 0), outcome(2, 0.02, 40), outcome(3, 0.04, 60)],
                 "abcd", own=(0, 0, 30, 40))
    figures = report.round_figures(run, users=2)
    assert figures[0]["ttft_p50_ms"] == 200.0 and figures[0]["hit_tokens"] == 0
    assert figures[1]["ttft_p50_ms"] == 30.0 and figures[1]["hit_tokens"] == 100
    assert figures[1]["own_hits"] == 70 and figures[1]["connector_hits"] == 2
    runs = [{"arm": "alone", "round": r, "result": run} for r in range(3)]
    assert report.rounds_per_arm(runs, 2)["alone"][1]["hit_tokens"] == 100


def test_a_mismatch_is_placed_at_its_user_and_round_and_later_ones_follow_it():
    base = result([outcome(i, 0.1, 0) for i in range(4)], "abcd")
    # User 1's round-0 reply differs (another hit length); its round-1 prompt then differs, and so does the reply.
    other = result([outcome(0, 0.1, 0), outcome(1, 0.1, 16, (9, 9)), outcome(2, 0.1, 0), outcome(3, 0.1, 0, (3,))],
                   "abcX")
    runs = [{"arm": "alone", "round": 0, "result": base}, {"arm": "tiercache", "round": 0, "result": other}]
    tally = report.compare_chat(runs, users=2)["arms"]["tiercache"]
    assert tally["compared"] == 4 and tally["identical"] == 2
    assert tally["causes"] == {DIFFERENT_HIT: 1, report.FOLLOWS: 1}
    assert tally["first_difference"] == {"0": {"chat_round": 0, "user": 1, "cause": DIFFERENT_HIT}}
    assert [(m["user"], m["chat_round"]) for m in tally["mismatches"]] == [(1, 0), (1, 1)]


def test_round_ratios_start_after_the_restart():
    runs = [{"arm": arm, "round": 0, "result": result([outcome(i, t, 0) for i in range(6)], "abcdef")}
            for arm, t in (("restart", 0.05), ("alone-restart", 0.1))]
    rows = report.compare_rounds(runs, users=2, rounds=3)
    assert [(r["arm"], list(r["rounds"])) for r in rows] == [("restart", [1, 2])]
    assert rows[0]["rounds"][1]["TTFT p50"]["ratio"] == 0.5


def test_every_chat_arm_runs_as_its_name_says(monkeypatch):
    """Restart arms (their A/A twins too) run in two phases of the closed loop; offloading arms through
    arm_offloading; the rest as one engine (nothing started here: the runners are recorded)."""
    from types import SimpleNamespace

    from lab import chat_rounds

    calls = []
    for runner in ("arm_offloading", "restarted", "one_engine"):
        monkeypatch.setattr(chat_rounds, runner,
                            lambda *args, runner=runner, **kwargs: calls.append((runner, kwargs)) or {})
    bench = SimpleNamespace(engine=lambda: SimpleNamespace(), equal_kv_bytes=1)
    monkeypatch.setattr(chat_rounds.dataclasses, "replace", lambda settings, **changes: settings)
    for name in chat_rounds.ARMS:
        calls.clear()
        chat_rounds.run_arm(bench, SPEC, name)
        (runner, kwargs), = calls
        base = chat_rounds.CONNECTOR.get(name, name).removesuffix("-again")
        assert runner == ("arm_offloading" if base.startswith("offload") else
                          "restarted" if base.endswith("restart") else "one_engine"), name
        assert ("parts" in kwargs and kwargs["parts"] is not None) == base.endswith("restart"), name
        assert ("drive" in kwargs) != base.endswith("restart"), name
