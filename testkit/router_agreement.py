"""A router following a pod's KV events, against Lookup: what the router-agreement tests (tests/events/
test_router_agreement.py, tests/dynamo) run and benchmarks/events_shared_prefix.py times. A slice of the Mooncake
conversation trace, a server publishing events with small tiers, a connector's saves into it
(tiercache.bench.SimulatedEngine), a router following the pod's stream, and per prompt what Lookup and the router say
and what the router should say (test_router_agreement's docstring: why)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testkit import mooncake_trace
from testkit.checkpoint_index import CheckpointIndex
from testkit.llmd_subscriber import Feeds
from testkit.saved_chunks import chunks, prompt, spec_of
from tiercache.bench import SimulatedEngine
from tiercache.client import Client
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor
from tiercache.process import ServerProcess

UNKNOWN = 2  # a token no saved sequence has: trace prompts' tokens start at 3, and so do the outputs made here
MODEL = "tiny"
# A hybrid model whose recurrent state (4 KiB) outweighs a chunk's kv (512 B), as real ones' do (Qwen3.5-0.8B: MiBs
# of state, a few of kv per chunk): states then leave the tiers before the kv chunks beside them, and a router that
# counts attention blocks alone counts blocks nothing can resume from.
HYBRID = ModelLayout(MODEL, (
    LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=4),
    LayerGroup(GroupKind.RECURRENT, (1, 2), state=(StateTensor("ssm", (2, 16, 16), "float32"),))))


def trace_slice(requests: int, one_in: int, max_input: int) -> list[mooncake_trace.TraceRequest]:
    spec = mooncake_trace.SliceSpec(max_requests=requests, conversations=one_in, max_input_tokens=max_input,
                                    max_output_tokens=48, vocab=1024)
    return mooncake_trace.load(mooncake_trace.CONVERSATION_SLICE, spec)


class LlmdRouter:
    """A router following llm-d's rules (llmd_index.py), fed from the pod's real ZMQ sockets."""

    def __init__(self, endpoints, n: int) -> None:
        self.feeds = Feeds()
        self.feeds.add("pod", endpoints.endpoint, endpoints.replay_endpoint)

    def matched(self, tokens) -> int:
        return self.feeds.index.matched_tokens(list(tokens), MODEL, "pod")

    def until(self, condition, timeout_s: float = 30.0) -> None:
        self.feeds.until(condition, timeout_s)

    def close(self) -> None:
        self.feeds.close()


class CheckpointRouter(LlmdRouter):
    """The llm-d-rules router that also reads the checkpoints' `mamba` events (checkpoint_index.py)
    from the same stream: `matched` is llm-d's count as before, `resumable` the checkpoint-aware one, in tokens."""

    def __init__(self, endpoints, n: int) -> None:
        self.index = CheckpointIndex()
        self.feeds = Feeds(self.index)
        self.feeds.add("pod", endpoints.endpoint, endpoints.replay_endpoint)

    def matched(self, tokens) -> int:
        return self.index.attention.matched_tokens(list(tokens), MODEL, "pod")

    def resumable(self, tokens) -> int:
        """Where the router expects `tokens` to resume: a checkpoint at most at the last token but one."""
        return self.index.matched_tokens([int(t) for t in tokens], MODEL, "pod")


@dataclass
class Pod:
    """A server publishing events, an engine saving into it, and a router following its pod's stream (`matched`:
    the prompt tokens it counts as cached; `until`: keep reading its stream until a condition holds)."""

    server: ServerProcess
    client: Client
    engine: SimulatedEngine
    router: LlmdRouter
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
        self.router.until(lambda: self.router.matched(marker) >= self.n)

    def router_blocks(self, tokens) -> int:
        return self.router.matched(tokens) // self.n

    def reach(self, tokens) -> int:
        """Lookup's hit for `tokens` followed by a token nothing saved has."""
        return self.engine.cache.lookup(np.append(np.asarray(tokens), UNKNOWN)).hit.tokens

    def close(self) -> None:
        self.router.close()
        self.client.close()
        self.server.kill()


def start_pod(folder: Path, layout, *flags: str, router=LlmdRouter, flush_interval_s: float = 0.01) -> Pod:
    """A Pod on a fresh `tiercache serve --events` (host and disk tiers of 256 KiB and 1 MiB, its disk in `folder`,
    events flushed every `flush_interval_s`: 10 ms, a busy server's setting; the default is 0.1), the pod
    registered, `router(endpoints, N)` following it."""
    config = folder / "events.yaml"
    config.write_text(f"events:\n  flush_interval_s: {flush_interval_s}\n")
    server = ServerProcess("--config", str(config), "--disk-dir", str(folder / "disk"), "--events", "--no-data-channel",
                           "--host-mem", "256KiB", "--disk-size", "1MiB", *flags).start()
    try:
        client = Client.from_url(server.url, same_host=False)
        spec = spec_of(layout)
        endpoints = client.register_pod("pod", MODEL, [spec.namespace], spec.shape, range(len(spec.shape.kinds)))
        engine = SimulatedEngine(PrefixCache(client, spec, report=False), seed=1, engine_blocks=True)
        return Pod(server, client, engine, router(endpoints, spec.chunk_tokens))
    except BaseException:
        server.kill()
        raise


@contextlib.contextmanager
def pods_in(tmp_path: Path, router=LlmdRouter):
    """start(layout, *serve flags) -> a Pod (start_pod) in its own folder under `tmp_path`, with `router` following
    it; every pod started is closed on leaving (the `pods` fixtures of the router tests)."""
    started: list[Pod] = []

    def start(layout, *flags: str) -> Pod:
        folder = tmp_path / f"pod{len(started)}"
        folder.mkdir()
        started.append(start_pod(folder, layout, *flags, router=router))
        return started[-1]

    try:
        yield start
    finally:
        for pod in started:
            pod.close()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class Agreement:
    """Per prompt, in whole blocks: Lookup's hit, the router's count, and the router's count predicted from Lookup
    (the module docstring); and in tokens, Lookup's hit and, for a router that reads checkpoints (`resumable`), its
    count of the prompt followed by the same unknown token."""

    lookup: list[int] = field(default_factory=list)
    router: list[int] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)
    expected: list[int] = field(default_factory=list)  # what a router with an `expected` method says it should count
    lookup_tokens: list[int] = field(default_factory=list)
    resumable: list[int] = field(default_factory=list)

    def note(self, pod: Pod, tokens: np.ndarray, saved: list[np.ndarray]) -> None:
        n = pod.n
        reach = pod.reach(tokens)
        hit = reach // n
        self.lookup.append(hit)
        self.lookup_tokens.append(reach)
        self.router.append(pod.router_blocks(tokens))
        if hasattr(pod.router, "expected"):
            self.expected.append(pod.router.expected(tokens))
        if hasattr(pod.router, "resumable"):
            self.resumable.append(pod.router.resumable(np.append(tokens, UNKNOWN)))
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


def serve_slice(requests: list[mooncake_trace.TraceRequest], *pods: Pod) -> list[Agreement]:
    """Each request as a router meets it: once every pod's router has caught up, what Lookup and the router say of
    its prompt; then its saves on every pod's engine (the same saves in each)."""
    saved: list[np.ndarray] = []
    found = [Agreement() for _ in pods]
    for request in requests:
        tokens = np.asarray(request.prompt)
        for pod, agreement in zip(pods, found):
            pod.caught_up()
            agreement.note(pod, tokens, saved)
        output = np.random.default_rng(request.index).integers(mooncake_trace.FIRST_TOKEN, 1024, request.max_tokens)
        for pod in pods:
            pod.engine.run(tokens, output)
        saved.append(np.concatenate([tokens, output]))
    return found


def evicted_and_lost(pod: Pod) -> tuple[int, int]:
    """Evictions from the host tier (demoted to disk) and from the disk tier (lost)."""
    tiers = {tier["name"]: tier for tier in pod.client.stats()["tiers"]}
    return tiers["host"]["evictions"], tiers["disk"]["evictions"]
