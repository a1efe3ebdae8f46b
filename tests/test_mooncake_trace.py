"""Mooncake traces turned into prompts (testkit/mooncake_trace.py): equal hash ids make equal tokens, so requests
share exactly the prefixes the trace says they share. (The serving benchmark that replays them runs on vLLM:
tests/vllm_engine.)"""

from __future__ import annotations

import json

import pytest

from testkit import mooncake_trace


@pytest.fixture
def trace_file(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [0, 7]},
            {"timestamp": 2000, "input_length": 1500, "output_length": 900, "hash_ids": [0, 1, 2]},
            {"timestamp": 4000, "input_length": 2000, "output_length": 9, "hash_ids": [0, 1, 2, 3]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_equal_hash_ids_are_equal_tokens_and_lengths_are_the_traces(trace_file):
    requests = mooncake_trace.load(trace_file, mooncake_trace.SliceSpec(max_output_tokens=16))
    assert [len(r.prompt) for r in requests] == [1200, 700, 1500, 2000]
    assert [r.max_tokens for r in requests] == [16, 3, 16, 9]
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 2.0, 4.0]
    first, other, repeat, longer = requests
    assert first.prompt[:512] == other.prompt[:512] and first.prompt[512:600] != other.prompt[512:600]
    assert repeat.prompt[:1200] == first.prompt and longer.prompt[:1500] == repeat.prompt
    assert min(min(r.prompt) for r in requests) >= mooncake_trace.FIRST_TOKEN
    # What an earlier prompt shares with each: block 0 (512) with the second; the whole first prompt (1200, it
    # ends inside block 2) with the third; the third's 1500 with the fourth.
    assert mooncake_trace.shared_prefix_tokens(requests) == 512 + 1200 + 1500


def test_caps_clock_scale_and_fresh_prompts(trace_file):
    spec = mooncake_trace.SliceSpec(start=1, max_requests=2, time_scale=0.5, max_input_tokens=1000, max_output_tokens=4)
    requests = mooncake_trace.load(trace_file, spec)
    assert [len(r.prompt) for r in requests] == [700, 1000] and [r.arrival_s for r in requests] == [0.0, 0.75]
    assert requests[1].hash_ids == (0, 1)  # the cap keeps the blocks the prompt still covers
    fresh = mooncake_trace.load(trace_file, mooncake_trace.SliceSpec(fresh=True))
    assert [len(r.prompt) for r in fresh] == [1200, 700, 1500, 2000]
    assert mooncake_trace.shared_prefix_tokens(fresh) == 0
    assert fresh[0].prompt[:512] != fresh[1].prompt[:512]


def test_conversation_sampling_keeps_whole_conversations(tmp_path):
    rows = [{"timestamp": i, "input_length": 1024 + 512 * turn, "output_length": 1,
             "hash_ids": [0, 100 + conversation, *range(1000 * conversation, 1000 * conversation + turn)]}
            for i, (conversation, turn) in enumerate((c, t) for t in range(3) for c in range(40))]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    kept = mooncake_trace.load(path, mooncake_trace.SliceSpec(max_requests=1000, conversations=4))
    conversations = {}
    for request in kept:
        conversations.setdefault(request.hash_ids[1], []).append(len(request.prompt))
    assert 0 < len(conversations) < 40
    assert all(lengths == [1024, 1536, 2048] for lengths in conversations.values())  # every turn of each kept
