"""An open-loop replay of trace requests against OpenAI-compatible servers: each request is sent at its arrival time
whether or not earlier ones have finished (as users arrive), streamed, so the time to first token is measured when
the first token reaches the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lab.common import percentiles
from testkit import mooncake_trace
from testkit.mooncake_trace import TraceRequest


@dataclass
class Outcome:
    index: int
    server: str
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # what the model generated (greedy: compared across arms)
    cached_tokens: int | None = None  # prompt tokens the engine did not compute (its own hit plus what it loaded)
    conversation: int | None = None  # the trace conversation it is a turn of (outputs.py: where its prefix came from)
    sent_s: float | None = None  # when it was sent, from the replay's start (outputs.py: which requests shared steps)
    # The log probability the engine gave each generated token: tokens alone can agree where a restore was wrong
    # (greedy picks the same token from different logits), so outputs are compared by these too.
    logprobs: list[float] = field(default_factory=list)


Route = Callable[[int, TraceRequest], int]  # (position in the replay, request) -> index of the server


def round_robin(position: int, request: TraceRequest) -> int:
    return position


def by_conversation(position: int, request: TraceRequest) -> int:
    """Session affinity: every turn of a conversation to the same server."""
    return mooncake_trace.conversation(request.hash_ids) & 0x7FFFFFFF


ROUTES = {"round-robin": round_robin, "conversation": by_conversation}


async def replay(requests: Sequence[TraceRequest], servers: Sequence[str], model: str,
                 on_done: Callable[[Outcome], None] = lambda outcome: None, timeout_s: float = 600.0,
                 route: Route = round_robin, sequential: bool = False,
                 extra: Callable[[TraceRequest], dict | None] = lambda request: None) -> tuple[list[Outcome], float]:
    """Send every request at its arrival time (offset from now) to the server `route` picks (round robin unless
    told); the outcomes in request order and the wall time from the first send to the last answer.

    `sequential`: one request at a time, each sent when the one before it is answered, arrival times ignored. No
    latency of such a replay is one a user sees; it exists for the output check (lab/serving/outputs.py): an
    engine that computes one request per step splits a prefill only where the request's own hit ends, so two arms
    with the same hit length must then generate the same tokens.

    `extra(request)`: vLLM's extra arguments for that request (`vllm_xargs`; exact.py's hit caps), or None."""
    import aiohttp  # in the vLLM venv; imported here so the report and plot code runs in a venv without it

    # A connection per request: a kept-alive connection that the server closes as it idles (uvicorn: after 5 s) can
    # be reused by the client at that very moment and come back reset, failing a request no server refused.
    limits = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        started = time.perf_counter()

        async def one(position: int, request: TraceRequest) -> Outcome:
            delay = request.arrival_s - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            sent_s = time.perf_counter() - started
            outcome = await complete(session, servers[route(position, request) % len(servers)], model, request,
                                     extra(request))
            outcome.sent_s = round(sent_s, 4)
            on_done(outcome)
            return outcome

        if sequential:
            outcomes = [await one(i, dataclasses.replace(r, arrival_s=0.0)) for i, r in enumerate(requests)]
        else:
            outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        return list(outcomes), time.perf_counter() - started


async def complete(session, server: str, model: str, request: TraceRequest, xargs: dict | None = None) -> Outcome:
    """One streamed completion on an aiohttp session; the time to its first token and to its end."""
    import aiohttp

    body = {"model": model, "prompt": list(request.prompt), "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
            "logprobs": 1, "return_tokens_as_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    sent = time.perf_counter()
    outcome = Outcome(request.index, server, ok=False,
                      conversation=mooncake_trace.conversation(request.hash_ids) if request.hash_ids else None)
    try:
        async with session.post(server + "/v1/completions", json=body) as answer:
            if answer.status != 200:
                outcome.error = f"HTTP {answer.status}: {(await answer.text())[:200]}"
                return outcome
            async for line in answer.content:
                event = line.strip()
                if not event.startswith(b"data:") or event == b"data: [DONE]":
                    continue
                message = json.loads(event[5:])
                ids = [t for c in message.get("choices") or () for t in c.get("token_ids") or ()]
                outcome.logprobs += [float(x) for c in message.get("choices") or ()
                                     for x in (c.get("logprobs") or {}).get("token_logprobs") or ()]
                if ids and not outcome.output_tokens:
                    outcome.ttft_s = time.perf_counter() - sent
                outcome.output_tokens += len(ids)
                outcome.token_ids += ids
                details = (message.get("usage") or {}).get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    outcome.cached_tokens = int(details["cached_tokens"])
        outcome.e2e_s = time.perf_counter() - sent
        outcome.ok = outcome.output_tokens > 0
        if not outcome.ok:
            outcome.error = "no token streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def summary(outcomes: Sequence[Outcome], wall_s: float) -> dict:
    """Latency percentiles (ms) over the requests that succeeded, throughput over the whole replay (the offered rate
    in an open-loop replay that the engines keep up with: a throughput figure comes from a saturated replay)."""
    good = [o for o in outcomes if o.ok]
    return {"requests": len(outcomes), "errors": len(outcomes) - len(good),
            "ttft_ms": percentiles([o.ttft_s for o in good], (50, 90, 99), scale=1e3),
            "e2e_ms": percentiles([o.e2e_s for o in good], (50, 90), scale=1e3),
            "throughput_rps": round(len(good) / wall_s, 3) if wall_s > 0 else 0.0,
            "wall_s": round(wall_s, 2)}

