"""The fleet benchmark's router (lab/fleet/router.py): round robin takes turns, ties go to the least loaded
pod, and once it has caught up with a request's saves (two batches stamped after them) its index of a real server's
KV events holds every block the pod can restore of that request: it never counts less than Lookup's hit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lab.fleet.clock import PodClocks
from lab.fleet.ideal import resumable_prefix
from lab.fleet.pods import SimulatedPod
from lab.fleet.router import Router
from testkit import mooncake_trace
from testkit.saved_chunks import N, spec_of
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor

MODEL = "tiny"
UNKNOWN = 2  # no prompt here holds it: Lookup of prompt + UNKNOWN is what the router may count of the prompt
# One attention layer beside two recurrent ones, their state small: the chains a hybrid pod saves, at N = 32.
STATE = (StateTensor("ssm", (2, 4, 4), "float32"),)
HYBRID = ModelLayout(MODEL, (LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=4),
                             LayerGroup(GroupKind.RECURRENT, (1, 2), state=STATE)))


def test_round_robin_takes_turns_and_reads_no_events():
    router = Router("round-robin", ["a", "b", "c"], MODEL)
    assert [router.pick([5] * 40, {})[0] for _ in range(4)] == ["a", "b", "c", "a"]
    assert router.scores([5] * 40) == {}


@pytest.mark.parametrize("policy", ["attention", "restorable", "checkpoints"])
def test_ties_go_to_the_least_loaded_pod_then_in_turn(policy):
    router = Router(policy, ["a", "b"], MODEL)
    try:
        assert router.pick([5] * 40, {"a": 1.0, "b": 0.5}) == ("b", 0)  # nothing indexed: every pod scores 0
        assert {router.pick([5] * 40, {"a": 0.0, "b": 0.0})[0] for _ in range(2)} == {"a", "b"}
    finally:
        router.close()


def test_the_queue_model_delays_a_busy_pod():
    clocks = PodClocks(["a", "b"])
    assert clocks.admit("a", 0.0, 2.0) == (0.0, 2.0)
    assert clocks.admit("a", 1.0, 0.5) == (1.0, 1.5)  # waits for the first until 2.0
    assert clocks.backlog(2.0) == {"a": 0.5, "b": 0.0}
    with pytest.raises(ValueError):
        Router("nearest", ["a"], MODEL)


def test_the_ideal_resumes_at_block_boundaries_or_at_an_earlier_prompts_end(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 1, "input_length": 700, "output_length": 5, "hash_ids": [0, 7]},
            {"timestamp": 2, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 3, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3]},
            {"timestamp": 4, "input_length": 1800, "output_length": 5, "hash_ids": [0, 1, 2, 4]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    requests = mooncake_trace.load(path, mooncake_trace.SliceSpec())
    # The second shares the first's 512-token block 0 (no checkpoint there at N = 560); the third and fourth resume
    # at the previous prompt's end; the fifth shares 1,536 tokens with the fourth, which ended further on: 2 x 560.
    assert resumable_prefix(requests, 560) == [0, 0, 1200, 1500, 1120]
    assert resumable_prefix(requests, 256) == [0, 512, 1200, 1500, 1536]


def test_a_router_that_caught_up_counts_every_restorable_block_of_what_was_served():
    spec = spec_of(HYBRID)
    pod = SimulatedPod("pod-0", MODEL, spec, advertise="restorable", host_mem="64MiB", disk_size="0", seed=0).start()
    router = Router("restorable", ["pod-0"], MODEL)
    try:
        router.follow("pod-0", pod.endpoints.endpoint, pod.endpoints.replay_endpoint)
        rng = np.random.default_rng(0)
        conversation = rng.integers(3, 50_000, 3 * N + 5)
        done_at = {"pod-0": float("-inf")}
        hits = []
        for turn in range(4):
            router.catch_up(done_at)
            assert router.pick(list(conversation), {})[0] == "pod-0"
            output = rng.integers(3, 50_000, 7)
            served = pod.serve(conversation, output)
            hits.append(served.hit_tokens)
            done_at["pod-0"] = served.done_at
            router.catch_up(done_at)
            for sequence in (conversation, np.concatenate([conversation, output])):
                restorable = pod.cache.lookup(np.append(sequence, UNKNOWN)).hit.tokens
                assert restorable >= N  # not vacuous
                matched = router.scores(list(sequence)).get("pod-0", (0, 0.0))[0]
                assert matched >= restorable // N * N
            conversation = np.concatenate([conversation, output, rng.integers(3, 50_000, N + 3)])
        assert all(h > 0 for h in hits[1:])  # each turn resumed from the last
    finally:
        router.close()
        pod.close()
