"""tiercache's KV events read by Dynamo 1.6.1's own consumer of vLLM's wire format: its standalone indexer
(`python -m dynamo.indexer`, Rust, from the ai-dynamo-runtime wheel), registered on a real server's pod endpoints over
real ZMQ sockets and asked over HTTP (/register, /query, /dump).

What Dynamo 1.6.1 uses (docs/events.md): BlockStored of kinds full_attention, mla_attention, sink_full_attention,
whose block_size is the one registered; it recomputes its own block keys from token_ids; `medium` CPU becomes its
host_pinned tier and STORAGE (LOCAL) its disk tier, REMOTE events are dropped; mamba blocks are dropped. Its /query
answers twice: `scores` (worker -> dp rank -> tokens) counts device blocks only, and `instances` (Mooncake's indexer
shape: worker -> longest_matched, gpu, cpu, disk, dp) counts every tier: `longest_matched` the prompt's tokens in
blocks of any tier, `gpu` / `cpu` / `disk` the prefix held in that tier or a faster one. So:
- with the honest media (CPU, STORAGE), Dynamo indexes exactly the blocks tiercache advertises, under host_pinned and
  disk; on a trace slice of a hybrid model its `longest_matched` is, on every prompt, the advertised blocks it
  reaches walking the device tier, then host_pinned, then disk, never back to a faster one: the llm-d-rules
  router's count (tests/events/test_router_agreement.py: predicted from Lookup) unless a block on the host follows
  one on disk; `scores` is empty;
- with `events.medium_override: GPU`, `scores` counts them too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

from testkit.event_subscriber import Subscriber
from testkit.router_agreement import HYBRID, MODEL, LlmdRouter, evicted_and_lost, pods_in, serve_slice, trace_slice
from testkit.saved_chunks import N, chunks, engine_hash, prompt, spec_of
from tests.helpers import free_port
from tests.prefix.chains import ATTENTION

INSTANCE = 7


class DynamoRouter:
    """Dynamo's standalone indexer in a process of its own, with the pod registered as worker INSTANCE (dp rank 0)."""

    def __init__(self, endpoints, n: int) -> None:
        self.endpoints = endpoints
        self.n = n
        self.llmd = LlmdRouter(endpoints, n)  # beside it: which tier each block is in, as the stream says
        self._both = False
        self.port = free_port()
        self.log = tempfile.TemporaryFile("a+", prefix="dynamo-indexer-", suffix=".log")  # see tiercache.process
        self.process = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                                         "--threads", "1"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.http("/workers")
                break
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dynamo.indexer did not start: {self.output()}") from None
                time.sleep(0.1)
        # Dynamo replays from 0 when it first sees a live seq > 0: the server's heartbeat gives it one.
        self.http("/register", {"instance_id": INSTANCE, "endpoint": endpoints.endpoint, "model_name": MODEL,
                                "block_size": n, "replay_endpoint": endpoints.replay_endpoint})

    def http(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read() or b"null")

    def query(self, tokens) -> dict:
        return self.http("/query", {"token_ids": [int(t) for t in tokens], "model_name": MODEL})

    def matched(self, tokens) -> int:
        """Dynamo's /query of the pod: prompt tokens in blocks it holds, in any tier (`longest_matched`); while
        `until` waits, the lesser of that and the llm-d-rules router's (both must have caught up)."""
        found = int(self.query(tokens).get("instances", {}).get(str(INSTANCE), {}).get("longest_matched", 0))
        return min(found, self.llmd.matched(tokens)) if self._both else found

    def expected(self, tokens) -> int:
        """The blocks Dynamo 1.6.1 should count, from the tiers the stream gave each block: it walks the prompt's
        blocks through the device tier, then on through host_pinned, then disk, and never back to a faster tier (a
        chain on disk whose last block is on the host counts without that block)."""
        index = self.llmd.feeds.index
        keys = index.request_keys(list(tokens), MODEL)
        per = self.n // index.block_size
        speed = {"gpu": 0, "cpu": 1}  # anything else: disk
        phase = blocks = 0
        for start in range(0, len(keys) - per + 1, per):
            tiers = set.intersection(*({t for pod, t, _ in index.holders.get(k, ()) if pod == "pod"}
                                       for k in keys[start:start + per]))
            reachable = [speed.get(t, 2) for t in tiers if speed.get(t, 2) >= phase]
            if not reachable:
                break
            phase = min(reachable)
            blocks += 1
        return blocks

    def blocks_by_tier(self) -> Counter:
        """From /dump ({"<model>:<routing group>": {"block_size", "events": [RouterEvent]}}): blocks per tier."""
        held: Counter = Counter()
        for tree in self.http("/dump").values():
            for event in tree["events"]:
                stored = event["event"]["data"].get("stored")
                if stored is not None and event["worker_id"] == INSTANCE:
                    held[event["storage_tier"]] += len(stored["blocks"])
        return held

    def until(self, condition, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        self._both = True
        try:
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Dynamo's indexer did not catch up within {timeout_s} s: {self.output()}")
                self.llmd.feeds.pump(0.05)
        finally:
            self._both = False

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def close(self) -> None:
        self.llmd.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def pods(tmp_path):
    """pods(layout, *serve flags) -> a Pod on a fresh server followed by Dynamo's indexer; all closed afterwards."""
    with pods_in(tmp_path, DynamoRouter) as start:
        yield start


def _settled_inventory(router: "DynamoRouter") -> tuple[dict, Counter]:
    """What tiercache advertises once the puts' changes are all published ({block hash: medium}, blocks per Dynamo
    tier), with Dynamo's index caught up to it. The replay answers the index as of its last flush, so first two live
    batches sent after the puts (each flush takes every change noted before it), then snapshots until one is the same
    as the one before it once Dynamo has caught up with that (nothing moved in between)."""
    subscriber = Subscriber(router.endpoints.endpoint, router.endpoints.replay_endpoint).ready()
    try:
        done = time.time()
        for _ in range(2):
            subscriber.until(lambda batch: batch[0] > done)
        previous = None
        while True:
            (_, _, batch), *_ = subscriber.replay(0)
            medium = {e["block_hashes"][0]: e["medium"] for e in batch[1] if e["type"] == "BlockStored"}
            advertised = Counter({"CPU": "host_pinned", "STORAGE": "disk"}[m] for m in medium.values())
            router.until(lambda: router.blocks_by_tier() == advertised)
            if medium == previous:
                return medium, advertised
            previous = medium
    finally:
        subscriber.close()


def test_dynamo_indexes_the_advertised_blocks_by_tier_and_scores_device_blocks_only_in_scores(pods):
    pod = pods(ATTENTION)  # the tiers' own media: CPU and STORAGE
    spec = spec_of(ATTENTION)
    prompts = [prompt(seed, 100) for seed in range(12)]
    for tokens in prompts:  # more than the host tier holds: the oldest chains go to disk, then some are lost
        pod.client.put_many(spec.namespace, chunks(spec, tokens, kv=3, payload_bytes=40 << 10))
    assert evicted_and_lost(pod) >= (1, 1)
    router: DynamoRouter = pod.router
    medium, advertised = _settled_inventory(router)
    assert set(advertised) == {"host_pinned", "disk"}
    for tokens in prompts:
        media = [medium.get(engine_hash(tokens, k * N)) for k in (1, 2, 3)]
        held = (media + [None]).index(None)  # the chain's blocks from the first one
        fast = (media[:held] + ["STORAGE"]).index("STORAGE")  # of those, on the host tier
        answer = router.query(tokens)
        assert answer["scores"] == {}  # device blocks only: none
        expected = {"longest_matched": held * N, "gpu": 0, "cpu": fast * N, "disk": held * N} if held else None
        found = answer["instances"].get(str(INSTANCE))
        assert ({k: found[k] for k in ("longest_matched", "gpu", "cpu", "disk")} if found else None) == expected


def test_dynamos_longest_match_is_the_routers_count_on_a_trace_slice_of_a_hybrid_model(pods):
    requests = trace_slice(32, 128, 1000)
    pod = pods(HYBRID)
    (found,) = serve_slice(requests, pod)
    assert evicted_and_lost(pod) >= (1, 1)
    # Dynamo counts what tiercache advertises, in the tiers it says, on every prompt; the llm-d-rules router's count
    # (predicted from Lookup) where the prompt's blocks never go back to a faster tier (on most).
    assert found.router == found.expected
    assert all(d <= p for d, p in zip(found.router, found.predicted))
    assert sum(d == p for d, p in zip(found.router, found.predicted)) >= 0.9 * len(requests)
    assert found.agreeing() >= 0.85 * len(requests) and sum(h > 0 for h in found.lookup) >= len(requests) // 2


def test_with_the_gpu_medium_dynamos_device_scores_count_the_blocks_too(pods):
    pod = pods(ATTENTION, "--events-medium", "GPU")
    spec = spec_of(ATTENTION)
    tokens = prompt(1, 100)
    pod.client.put_many(spec.namespace, chunks(spec, tokens, kv=3))
    router: DynamoRouter = pod.router
    router.until(lambda: router.matched(tokens) == 3 * N)
    answer = router.query(tokens)
    assert answer["scores"] == {str(INSTANCE): {"0": 3 * N}}
    assert answer["instances"][str(INSTANCE)]["gpu"] == 3 * N
