"""A router index built from a real server's KV events agrees with Lookup on every prompt of a slice of the Mooncake
conversation trace (issue 27's "Done when"), for a hybrid model and an attention-only one.

The saves are a connector's (tiercache.bench.SimulatedEngine through PrefixCache: every full kv chunk of the prompt
and of prompt + output, with tokens and the engine's block hashes on the anchor group's chunks, a state at every
chunk boundary of the prompt, tail + state at the prompt's end and at the output's) into `tiercache serve --events`
with host and disk tiers small enough that chains are demoted and lost during the slice. The router is
benchmarks/fleet/llmd_index.py (llm-d's rules) fed from the pod's real ZMQ sockets; it has caught up when it holds a
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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from benchmarks.fleet.llmd_subscriber import Feeds
from benchmarks.serving import trace
from tests.events.saves import chunks, prompt, spec_of
from tests.helpers import ROOT, ServerProcess
from tests.prefix.chains import ATTENTION, layout
from tiercache.bench import SimulatedEngine
from tiercache.client import Client
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.layout import GroupKind, LayerGroup, StateTensor

TRACE = ROOT.parent / "shared" / "traces" / "mooncake-conversation.jsonl"
UNKNOWN = 2  # a token no saved sequence has: trace prompts' tokens start at 3, and so do the outputs made here
MODEL = "tiny"
# A hybrid model whose recurrent state (4 KiB) outweighs a chunk's kv (512 B), as real ones' do (Qwen3.5-0.8B: MiBs
# of state, a few of kv per chunk): states then leave the tiers before the kv chunks beside them, and a router that
# counts attention blocks alone counts blocks nothing can resume from.
HYBRID = layout(LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=4),
                LayerGroup(GroupKind.RECURRENT, (1, 2), state=(StateTensor("ssm", (2, 16, 16), "float32"),)))


def trace_slice(requests: int, one_in: int, max_input: int) -> list[trace.TraceRequest]:
    if not TRACE.exists():
        pytest.skip(f"the trace is not here: {TRACE}")
    return trace.load(TRACE, trace.SliceSpec(max_requests=requests, conversations=one_in, max_input_tokens=max_input,
                                             max_output_tokens=48, vocab=1024))


@dataclass
class Pod:
    """A server publishing events, an engine saving into it, and a router index following its pod's stream."""

    server: ServerProcess
    client: Client
    engine: SimulatedEngine
    feeds: Feeds
    markers: int = 0

    @property
    def n(self) -> int:
        return self.engine.spec.chunk_tokens

    def caught_up(self) -> None:
        """Put a one-block marker chain, its kv chunk last (its state before it: the server places a put's chunks in
        order), and pump the router until it holds the block: the change that advertises it is the last the server
        noted, and a flush takes every change noted before it."""
        spec = self.engine.spec
        self.markers += 1
        marker = prompt(10_000 + self.markers, self.n + 1)
        states = [self.n] if spec.shape.recurrent else []
        self.client.put_many(spec.namespace, chunks(spec, marker, states=states) + chunks(spec, marker, kv=1))
        self.feeds.until(lambda: self.feeds.index.matched_tokens(marker, MODEL, "pod") >= self.n)

    def router_blocks(self, tokens) -> int:
        return self.feeds.index.matched_tokens(list(tokens), MODEL, "pod") // self.n

    def reach(self, tokens) -> int:
        """Lookup's hit for `tokens` followed by a token nothing saved has."""
        return self.engine.cache.lookup(np.append(np.asarray(tokens), UNKNOWN)).hit.tokens

    def close(self) -> None:
        self.feeds.close()
        self.client.close()
        self.server.kill()


@pytest.fixture
def pods(tmp_path):
    """pods(layout, *serve flags) -> a Pod on a fresh server; all closed afterwards."""
    started: list[Pod] = []
    config = tmp_path / "events.yaml"
    config.write_text("events:\n  flush_interval_s: 0.05\n")  # a router catches up sooner: the test runs sooner

    def start(layout, *flags: str) -> Pod:
        disk = tmp_path / f"disk{len(started)}"
        server = ServerProcess("--config", str(config), "--disk-dir", str(disk), "--events", "--no-data-channel",
                               "--host-mem", "256KiB", "--disk-size", "1MiB", *flags).start()
        client = Client.from_url(server.url, same_host=False)
        spec = spec_of(layout)
        endpoints = client.register_pod("pod", MODEL, [spec.namespace], spec.shape, range(len(spec.shape.kinds)))
        feeds = Feeds()
        feeds.add("pod", endpoints.endpoint, endpoints.replay_endpoint)
        pod = Pod(server, client, SimulatedEngine(PrefixCache(client, spec, report=False), seed=1,
                                                  engine_blocks=True), feeds)
        started.append(pod)
        return pod

    yield start
    for pod in started:
        pod.close()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class Agreement:
    """Per prompt, in whole blocks: Lookup's hit, the router's count, and the router's count predicted from Lookup
    (the module docstring)."""

    lookup: list[int] = field(default_factory=list)
    router: list[int] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)

    def note(self, pod: Pod, tokens: np.ndarray, saved: list[np.ndarray]) -> None:
        n = pod.n
        hit = pod.reach(tokens) // n
        self.lookup.append(hit)
        self.router.append(pod.router_blocks(tokens))
        # The prediction is at least Lookup's own (the checkpoint it resumes at lies on some saved sequence through
        # the prompt); only a sequence sharing more blocks than that can raise it (Lookup calls for those alone).
        predicted = hit
        for shared, sequence in sorted(((common_prefix(tokens, s) // n, s) for s in saved), key=lambda x: -x[0]):
            if shared <= predicted:
                break
            predicted = max(predicted, min(shared, pod.reach(sequence) // n))
        self.predicted.append(predicted)

    def agreeing(self) -> int:
        return sum(r == h for r, h in zip(self.router, self.lookup))


def serve_slice(requests: list[trace.TraceRequest], *pods: Pod) -> list[Agreement]:
    """Each request as a router meets it: once every pod's router has caught up, what Lookup and the router say of
    its prompt; then its saves on every pod's engine (the same saves in each)."""
    saved: list[np.ndarray] = []
    found = [Agreement() for _ in pods]
    for request in requests:
        tokens = np.asarray(request.prompt)
        for pod, agreement in zip(pods, found):
            pod.caught_up()
            agreement.note(pod, tokens, saved)
        output = np.random.default_rng(request.index).integers(trace.FIRST_TOKEN, 1024, request.max_tokens)
        for pod in pods:
            pod.engine.run(tokens, output)
        saved.append(np.concatenate([tokens, output]))
    return found


def evicted_and_lost(pod: Pod) -> tuple[int, int]:
    """Evictions from the host tier (demoted to disk) and from the disk tier (lost)."""
    tiers = {tier["name"]: tier for tier in pod.client.stats()["tiers"]}
    return tiers["host"]["evictions"], tiers["disk"]["evictions"]


def check_hybrid(pods, requests: list[trace.TraceRequest]) -> tuple[Agreement, Agreement]:
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
    return exact, ignorant


def test_a_router_index_agrees_with_lookup_on_a_trace_slice_of_a_hybrid_model(pods):
    exact, ignorant = check_hybrid(pods, trace_slice(32, 128, 1000))
    print(f"hybrid: {exact.agreeing()} of {len(exact.lookup)} prompts agree with Lookup ({ignorant.agreeing()} "
          f"attention blocks only); blocks hit {sum(exact.lookup)}, router {sum(exact.router)}, attention "
          f"{sum(ignorant.router)}")


def test_a_router_index_agrees_with_lookup_on_every_prompt_of_an_attention_model(pods):
    requests = trace_slice(32, 128, 1000)
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
    assert arrays.feeds.index.holders == maps.feeds.index.holders and not arrays.feeds.index.skipped.get(
        "undecodable_batch")
