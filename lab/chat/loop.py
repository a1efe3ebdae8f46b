"""Users in a closed loop, as LMCache's multi-round QA benchmark runs them: user u's round r prompt is its round r-1
prompt, the model's actual reply to it (the token ids the server generated) and a new question; the user waits for
the reply, idles `gap_s`, then asks the next. Round 0 is a system prompt every user shares, a context of the user's
own and the first question. Token ids are drawn from [3, vocab) by generators seeded by (part, user, round): the same
in every process and arm; only the replies make prompts differ, and only where an engine answered otherwise.

Each request's figures are the serving benchmark's (replay.complete: TTFT, generated ids, cached tokens). vLLM counts
its own prefix-cache hits and a connector's per engine, not per request: after each reply the loop reads the engine's
counters and charges their change since the last reading to that request (`own_hits`, `connector_hits`). That is
exact when requests do not overlap; under load a request may be charged a neighbour's hits (the per-run totals are
exact), so per-round splits are an attribution by time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import xxhash

from lab.serving.engines import VLLM_COUNTERS
from lab.serving.prometheus import prometheus_sum
from lab.serving.replay import Outcome, complete
from testkit.mooncake_trace import FIRST_TOKEN, TraceRequest

SYSTEM, CONTEXT, QUESTION = 0, 1, 2  # the parts of a prompt, in the generators' seeds


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    users: int = 16
    rounds: int = 6
    system_tokens: int = 1024
    context_tokens: int = 3072
    question_tokens: int = 64
    answer_tokens: int = 32
    vocab: int = 1024
    gap_s: float = 4.0
    stagger_s: float = 0.5

    @property
    def max_prompt_tokens(self) -> int:
        """The last round's prompt: every question and every reply but the last."""
        return (self.system_tokens + self.context_tokens + self.rounds * self.question_tokens
                + (self.rounds - 1) * self.answer_tokens)


def tokens(spec: ChatSpec, length: int, *seed: int) -> list[int]:
    return np.random.default_rng([7, *seed]).integers(FIRST_TOKEN, spec.vocab, length).tolist()


def first_prompt(spec: ChatSpec, user: int) -> list[int]:
    """Round 0: the shared system prompt, the user's context, the first question."""
    return (tokens(spec, spec.system_tokens, SYSTEM) + tokens(spec, spec.context_tokens, CONTEXT, user)
            + tokens(spec, spec.question_tokens, QUESTION, user, 0))


def next_prompt(spec: ChatSpec, user: int, previous: list[int], reply: list[int], round_: int) -> list[int]:
    """Round `round_`: the previous round's prompt, the reply to it, a new question."""
    return list(previous) + list(reply) + tokens(spec, spec.question_tokens, QUESTION, user, round_)


def build_prompt(spec: ChatSpec, user: int, replies: list[list[int]]) -> list[int]:
    """The prompt of round len(replies), given the replies to the rounds before it."""
    prompt = first_prompt(spec, user)
    for round_, reply in enumerate(replies, start=1):
        prompt = next_prompt(spec, user, prompt, reply, round_)
    return prompt


def prompt_hash(prompt) -> str:
    return xxhash.xxh64_hexdigest(np.asarray(prompt, dtype=np.int32).tobytes())


class ChatLoop:
    """One arm's users: their prompts so far, the replies, a record per request. Phases (rounds [r0, r1)) run one
    after the other on the same loop: after a restart the users go on where they stopped."""

    def __init__(self, spec: ChatSpec) -> None:
        self.spec = spec
        self.prompts: dict[int, list[int]] = {}  # user -> the last prompt sent
        self.replies: dict[int, list[list[int]]] = {u: [] for u in range(spec.users)}
        self.records: dict[int, dict] = {}  # round * users + user -> what was sent, and the hits charged to it

    def phase(self, first: int, end: int) -> "ChatPhase":
        return ChatPhase(self, first, end)

    def prompt(self, user: int, round_: int) -> list[int]:
        if round_ == 0:
            return first_prompt(self.spec, user)
        return next_prompt(self.spec, user, self.prompts[user], self.replies[user][round_ - 1], round_)

    def sent(self) -> list[dict]:
        return [self.records[i] for i in sorted(self.records)]


class ChatPhase:
    """Rounds [first, end) of a loop, as measure() runs them: `drive` sends them (measure's closed-loop hook); the
    phase's length is its requests'; iterating gives the requests sent (after the run). Outcome index: round * users
    + user, in every phase (measure.merge keeps the indices of the phases it joins)."""

    def __init__(self, loop: ChatLoop, first: int, end: int) -> None:
        self.loop, self.first, self.end = loop, first, end
        self.requests: dict[int, TraceRequest] = {}

    def __len__(self) -> int:
        return self.loop.spec.users * (self.end - self.first)

    def __iter__(self):
        return iter(self.requests[i] for i in sorted(self.requests))

    async def drive(self, servers, model: str, on_done=lambda outcome: None) -> tuple[list[Outcome], float]:
        import aiohttp

        spec = self.loop.spec
        outcomes: dict[int, Outcome] = {}
        meter = Meter(servers)
        # A connection per request, as replay() (a kept-alive one the server closes as it idles can come back reset).
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                        timeout=aiohttp.ClientTimeout(total=600.0))
        async with session:
            await meter.read(session, None)
            started = time.perf_counter()

            async def user(u: int) -> None:
                await asyncio.sleep(u * spec.stagger_s)
                for round_ in range(self.first, self.end):
                    if round_ > self.first:
                        await asyncio.sleep(spec.gap_s)
                    prompt = self.loop.prompt(u, round_)
                    index = round_ * spec.users + u
                    request = TraceRequest(index, time.perf_counter() - started, tuple(prompt), spec.answer_tokens,
                                           ())
                    self.requests[index] = request
                    server = servers[u % len(servers)]
                    outcome = await complete(session, server, model, request)
                    self.loop.prompts[u] = prompt
                    self.loop.replies[u].append(list(outcome.token_ids))
                    record = {"index": index, "user": u, "round": round_,
                              "prompt_tokens": len(prompt), "prompt_hash": prompt_hash(prompt),
                              "sent_s": round(request.arrival_s, 3)}
                    record.update(await meter.read(session, server))
                    self.loop.records[record["index"]] = record
                    outcomes[index] = outcome
                    on_done(outcome)

            await asyncio.gather(*(user(u) for u in range(spec.users)))
            wall = time.perf_counter() - started
        return [outcomes[i] for i in sorted(outcomes)], wall


class Meter:
    """vLLM's hit counters per server, read after each reply: the change since the last reading of that server."""

    def __init__(self, servers) -> None:
        self.last: dict[str, tuple[float, float]] = {}
        self.servers = list(servers)
        self.lock = asyncio.Lock()

    async def read(self, session, server: str | None) -> dict:
        """The change on `server` since its last reading (None: read every server, charge nothing)."""
        async with self.lock:
            for url in self.servers if server is None else [server]:
                try:
                    async with session.get(url + "/metrics") as answer:
                        text = await answer.text()
                except Exception:  # noqa: BLE001 - a missing reading charges nothing; the totals come from measure()
                    return {"own_hits": None, "connector_hits": None}
                now = (prometheus_sum(text, VLLM_COUNTERS["local_hit_tokens"]),
                       prometheus_sum(text, VLLM_COUNTERS["external_hit_tokens"]))
                before, self.last[url] = self.last.get(url, now), now
            if server is None:
                return {}
            return {"own_hits": int(now[0] - before[0]), "connector_hits": int(now[1] - before[1])}
