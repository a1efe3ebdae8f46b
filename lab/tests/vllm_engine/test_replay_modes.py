"""The replay's two modes against a stand-in OpenAI server (aiohttp, the vLLM venv's): open loop sends every request
at its arrival whatever is in flight; sequential sends one at a time, so the output check can rely on one request per
engine step (lab/serving/outputs.py). The stand-in only answers; what is measured is the client's sending."""

from __future__ import annotations

import asyncio
import json

import pytest

from lab.serving.replay import replay
from testkit.mooncake_trace import TraceRequest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


class StandIn:
    """Streams two tokens per completion; records the most requests it ever held at the same time. `overlap`: each
    request is held until a second one is in flight (an open-loop client sends them whatever is in flight: waited
    for, not timed, so a loaded machine cannot fail it), else for 50 ms (time for a client that does not wait to send
    the next)."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.in_flight = self.most = 0
        self.order: list[int] = []
        self.overlapped = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.order.append(body["prompt"][0])
        if self.in_flight > 1:
            self.overlapped.set()
        if self.overlap:
            await asyncio.wait_for(self.overlapped.wait(), timeout=60)
        else:
            await asyncio.sleep(0.05)
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for token in (body["prompt"][0], 7):
            chunk = {"choices": [{"token_ids": [token]}]}
            await answer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await answer.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return answer


async def run_replay(sequential: bool) -> tuple[StandIn, list]:
    stand_in = StandIn(overlap=not sequential)
    app = web.Application()
    app.router.add_post("/v1/completions", stand_in.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    requests = [TraceRequest(i, 0.0, (100 + i, 5, 6), 2, ()) for i in range(6)]
    try:
        outcomes, _ = await replay(requests, [f"http://127.0.0.1:{port}"], "m", sequential=sequential)
    finally:
        await runner.cleanup()
    return stand_in, outcomes


def test_open_loop_sends_what_has_arrived_whatever_is_in_flight():
    stand_in, outcomes = asyncio.run(run_replay(sequential=False))
    assert all(o.ok for o in outcomes)
    assert stand_in.most > 1


def test_sequential_sends_one_request_at_a_time_in_trace_order():
    stand_in, outcomes = asyncio.run(run_replay(sequential=True))
    assert all(o.ok for o in outcomes) and [o.token_ids for o in outcomes] == [[100 + i, 7] for i in range(6)]
    assert stand_in.most == 1
    assert stand_in.order == [100 + i for i in range(6)]
