"""The fleet benchmark's router: picks a pod for each request.

Policies:
- `round-robin`: the next pod in turn; reads no events.
- `attention`: the longest prefix of attention blocks, from pods whose servers advertise every saved attention block
  (events.advertise: attention): what a router reading a hybrid engine's own KV events sees (llm-d and Dynamo index
  only attention kinds; an attention block without a checkpoint at or after it cannot be resumed from).
- `restorable`: the longest prefix tiercache can restore, from its default events (docs/events.md).
- `checkpoints`: tiercache's default events read by a router that also reads its checkpoints' `mamba` events
  (testkit/checkpoint_index.py): the deepest restorable checkpoint whose tokens follow in the prompt, to the
  token (a hit that ends mid-block included), at most the prompt's last token but one.
The event policies keep an index following llm-d's rules (testkit/llmd_index.py: canonical 16-token keys)
fed from every pod's real ZMQ sockets (testkit/llmd_subscriber.py), and send a request where it is expected
to cost least, weighing the prefill a pod would still have to do against the work it already has (as cost-based KV
routers do; Dynamo's weighs the blocks to prefill against a worker's load), in seconds of the simulated clock:
cost = load_weight x the pod's backlog (queued work, lab/fleet/clock.py) + the prompt tokens the index says it
does not hold x the per-token prefill cost. Ties go to the least loaded pod, then in turn (a new conversation on idle
pods). load_weight 0 is a longest-prefix router (llm-d's LongestPrefixScorer alone).

Catching up. Before a request is routed the index must hold the events of every request already served. A pod's
server stamps each batch with the time it was published (the payload's `ts`, time.time() on the same machine), and
its one publishing thread drains the store's changes, then publishes, flush after flush. So once a stream has
delivered two batches stamped at or after a request's saves returned, the second one's flush began after them and
took every change they made (a flush that finds nothing for a pod sends it nothing; the heartbeat, as short as the
flush interval here, keeps every stream moving). `catch_up` pumps until that holds for every pod: a condition, never
a sleep.
"""

from __future__ import annotations

import time
from typing import Sequence

import msgpack

from testkit.checkpoint_index import CheckpointIndex
from testkit.llmd_index import LlmdIndex
from testkit.llmd_subscriber import Feeds, PodFeed

POLICIES = ("round-robin", "attention", "restorable", "checkpoints")
EVENT_POLICIES = ("attention", "restorable", "checkpoints")


class StampedFeed(PodFeed):
    """A pod's feed that remembers the publish stamps of the last two batches it applied."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stamps = (float("-inf"), float("-inf"))  # (the one before the last, the last)

    def _deliver(self, seq: int, message: tuple[bytes, bytes]) -> None:
        super()._deliver(seq, message)
        unpacker = msgpack.Unpacker()
        unpacker.feed(message[1])
        try:
            unpacker.read_array_header()
            stamp = float(unpacker.unpack())
        except Exception:  # noqa: BLE001 - a batch the index dropped as undecodable carries no usable stamp
            return
        self.stamps = (self.stamps[1], stamp)

    def past(self, t: float) -> bool:
        """Two batches stamped at or after `t` applied: every change noted before `t` is in the index."""
        return self.stamps[0] >= t


class StampedFeeds(Feeds):
    def add(self, name: str, endpoint: str, replay_endpoint: str) -> PodFeed:
        feed = self.feeds[name] = StampedFeed(self.index, self.context, endpoint, replay_endpoint)
        return feed.connect()


class Router:
    def __init__(self, policy: str, pods: Sequence[str], model: str, load_weight: float = 1.0,
                 prefill_s_per_token: float = 78e-6, catch_up_timeout_s: float = 60.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy, self.pods, self.model = policy, list(pods), model
        self.load_weight, self.prefill_s_per_token = load_weight, prefill_s_per_token
        self.catch_up_timeout_s = catch_up_timeout_s
        self.turn = 0
        index = CheckpointIndex() if policy == "checkpoints" else LlmdIndex()
        self.feeds = StampedFeeds(index) if policy in EVENT_POLICIES else None
        self.caught_up_s = 0.0  # time spent waiting for the index, in all

    def follow(self, pod: str, endpoint: str, replay_endpoint: str) -> None:
        if self.feeds is not None:
            self.feeds.add(pod, endpoint, replay_endpoint)

    def catch_up(self, done_at: dict[str, float]) -> None:
        """Pump the pods' streams until the index holds every change made before `done_at[pod]` (see above)."""
        if self.feeds is None:
            return
        start = time.perf_counter()
        feeds = self.feeds.feeds
        self.feeds.until(lambda: all(feeds[pod].past(t) for pod, t in done_at.items()), self.catch_up_timeout_s)
        self.caught_up_s += time.perf_counter() - start

    def refresh(self) -> None:
        """Apply whatever the streams have delivered by now, waiting for nothing (real engines: see vllm_fleet.py)."""
        if self.feeds is not None:
            self.feeds.pump(0)

    def scores(self, prompt: Sequence[int]) -> dict[str, tuple[int, float]]:
        """{pod: (matched tokens, weighted score)} from the index; {} for round robin."""
        if self.feeds is None:
            return {}
        return self.feeds.index.score(prompt, self.model, self.pods)

    def pick(self, prompt: Sequence[int], backlog: dict[str, float]) -> tuple[str, int]:
        """The pod for `prompt`, and the tokens the router believes it holds there. `backlog`: the seconds of work
        each pod has queued. The event routers pick the least expected cost: load_weight x backlog + the prompt
        tokens the pod does not hold x prefill_s_per_token (see the module docstring)."""
        if self.feeds is None:
            pod = self.pods[self.turn % len(self.pods)]
            self.turn += 1
            return pod, 0
        scores = self.scores(prompt)
        matched = {p: min(scores.get(p, (0, 0.0))[0], len(prompt)) for p in self.pods}

        def cost(pod: str) -> float:
            return self.load_weight * backlog.get(pod, 0.0) + (len(prompt) - matched[pod]) * self.prefill_s_per_token

        costs = {p: cost(p) for p in self.pods}
        least = min(costs.values())
        tied = [p for p in self.pods if costs[p] == least]
        idlest = min(backlog.get(p, 0.0) for p in tied)
        tied = [p for p in tied if backlog.get(p, 0.0) == idlest]
        pod = tied[self.turn % len(tied)]
        self.turn += 1
        return pod, matched[pod]

    def skipped(self) -> dict[str, int]:
        """What the index skipped, by llm-d's reasons (mamba events, for one; the checkpoint index's own reasons are
        prefixed `checkpoint_`)."""
        if self.feeds is None:
            return {}
        index = self.feeds.index
        if isinstance(index, CheckpointIndex):
            return {**index.attention.skipped, **{f"checkpoint_{k}": v for k, v in index.skipped.items()}}
        return dict(index.skipped)

    def close(self) -> None:
        if self.feeds is not None:
            self.feeds.close()
