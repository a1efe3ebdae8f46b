"""A router index built from a real server's KV events agrees with Lookup on every prompt of a slice of the Mooncake
conversation trace, for a hybrid model and an attention-only one (docs/events.md, "Agreement with Lookup").

The saves are a connector's (tiercache.bench.SimulatedEngine through PrefixCache: every full kv chunk of the prompt
and of prompt + output, with tokens and the engine's block hashes on the anchor group's chunks, a state at every
chunk boundary of the prompt, tail + state at the prompt's end and at the output's) into `tiercache serve --events`
with host and disk tiers small enough that chains are demoted and lost during the slice. The router is
testkit/llmd_index.py (llm-d's rules) fed from the pod's real ZMQ sockets; it has caught up when it holds a
marker chain whose last object was the last put (a flush takes every change noted before it).

What must agree, and why (N: the events' block size; counts are whole N blocks, as the router's key matches inside
a block count nothing here: its partial keys are rounded down):
- Lookup's `hit` of the prompt followed by one token it does not know (the router counts the prompt's last token
  too; the engine always computes it, so Lookup of the bare prompt stops one token short);
- the router counts block k of the prompt iff some checkpoint at or after block k, on a branch through it, is
  restorable (docs/events.md). So where the prompt leaves a cached branch between a block and that branch's next
  restorable checkpoint, the router counts blocks the engine cannot resume from: it overcounts by less than the
  distance to that checkpoint. The test predicts this exactly from Lookup alone: with reach(S) = Lookup's hit of a
  saved sequence S (prompt + output) followed by an unknown token, the router's count of a prompt P is
  N * max over S of floor(min(common prefix of P and S, reach(S)) / N). It asserts that on every prompt, that it is
  never below Lookup's (it never undercounts), equal to Lookup's on most, and that hits are not rare.
- For an attention-only model there is no checkpoint to miss: the router's count equals Lookup's on every prompt.
- A router fed what an engine's own events say (events.advertise: attention: every saved attention block) ignores
  the recurrent state: on the hybrid model it disagrees with Lookup on some prompts.
- A router that also reads the checkpoints' `mamba` events (testkit/checkpoint_index.py: the deepest
  checkpoint on the prompt's matched path whose tokens follow in the prompt) counts exactly Lookup's hit on every
  prompt, in tokens: it is asked of the prompt followed by the unknown token, as Lookup is, and stops one token short
  of that, as Lookup does. The same stream feeds both counts (the pods' router is CheckpointRouter, whose `matched`
  is llm-d's), so the slice is served once.
"""

from __future__ import annotations

import pytest

from testkit import mooncake_trace
from testkit.router_agreement import (HYBRID, Agreement, CheckpointRouter, evicted_and_lost, pods_in, serve_slice,
                                      trace_slice)
from testkit.saved_chunks import N
from tests.prefix.chains import ATTENTION


@pytest.fixture
def pods(tmp_path):
    """pods(layout, *serve flags) -> a Pod on a fresh server, with an llm-d-rules router that also reads checkpoints;
    all closed afterwards."""
    with pods_in(tmp_path, CheckpointRouter) as start:
        yield start


def check_hybrid(pods, requests: list[mooncake_trace.TraceRequest]) -> tuple[Agreement, Agreement]:
    restorable = pods(HYBRID)
    attention = pods(HYBRID, "--events-advertise", "attention")
    exact, ignorant = serve_slice(requests, restorable, attention)
    host_evictions, disk_evictions = evicted_and_lost(restorable)
    assert host_evictions > 0 and disk_evictions > 0  # chains were demoted and lost during the slice
    assert exact.router == exact.predicted  # on every prompt
    assert all(r >= h for r, h in zip(exact.router, exact.lookup))  # never below what the engine can resume
    assert exact.agreeing() >= 0.9 * len(requests)
    assert sum(h > 0 for h in exact.lookup) >= len(requests) // 2  # not vacuous: hits are common
    assert ignorant.lookup == exact.lookup  # the same saves: the same store
    assert ignorant.agreeing() < exact.agreeing()  # counting attention blocks alone is wrong more often
    assert all(i >= r for i, r in zip(ignorant.router, exact.router))
    # Reading the checkpoints too: Lookup's hit on every prompt, to the token, mid-block hits included.
    assert exact.resumable == exact.lookup_tokens
    assert sum(h % restorable.n != 0 for h in exact.lookup_tokens) >= 2  # not vacuous: hits that end mid-block
    return exact, ignorant


def test_a_router_index_agrees_with_lookup_on_a_trace_slice_of_a_hybrid_model(pods):
    exact, ignorant = check_hybrid(pods, trace_slice(48, 128, 1000))
    print(f"hybrid: {exact.agreeing()} of {len(exact.lookup)} prompts agree with Lookup ({ignorant.agreeing()} "
          f"attention blocks only); blocks hit {sum(exact.lookup)}, router {sum(exact.router)}, attention "
          f"{sum(ignorant.router)}; tokens hit {sum(exact.lookup_tokens)} (mid-block on "
          f"{sum(h % N != 0 for h in exact.lookup_tokens)} prompts), checkpoint-aware router "
          f"{sum(exact.resumable)}")


def test_a_router_index_agrees_with_lookup_on_every_prompt_of_an_attention_model(pods):
    requests = trace_slice(48, 128, 1000)
    pod = pods(ATTENTION)
    (result,) = serve_slice(requests, pod)
    assert evicted_and_lost(pod)[0] > 0
    assert result.router == result.lookup == result.predicted
    assert sum(h > 0 for h in result.lookup) >= len(requests) // 2


@pytest.mark.slow
def test_a_router_index_agrees_with_lookup_on_a_longer_trace_slice_of_a_hybrid_model(pods):
    check_hybrid(pods, trace_slice(120, 128, 2000))


def test_the_router_reads_the_array_encoding_as_it_reads_maps(pods):
    requests = trace_slice(8, 128, 1000)
    maps, arrays = pods(HYBRID), pods(HYBRID, "--events-encoding", "array")
    by_maps, by_arrays = serve_slice(requests, maps, arrays)
    assert by_arrays.router == by_maps.router == by_maps.predicted and sum(by_maps.router) > 0
    maps.caught_up()
    arrays.caught_up()
    index_of_maps, index_of_arrays = maps.router.index, arrays.router.index
    assert index_of_arrays.attention.holders == index_of_maps.attention.holders
    assert not index_of_arrays.attention.skipped.get("undecodable_batch")
    assert index_of_arrays.at_block == index_of_maps.at_block and index_of_maps.at_block  # checkpoints read alike
    assert by_arrays.resumable == by_maps.resumable == by_maps.lookup_tokens
