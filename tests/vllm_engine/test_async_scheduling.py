"""Turn ends under vLLM's async scheduling, on the real CPU engine.

vLLM turns async scheduling on by default on GPUs (the CPU platform turns it off; engine_process.py lets an engine
ask for it back, `async_scheduling=True`): the step after a stop token is scheduled and run before the scheduler
knows the request stopped, so the request ends with its stop token computed too, and its end-of-request save must
carry that last step. The yardstick is an engine with sync scheduling stopped by length one token later: it feeds
the same tokens in the same steps (the prompt in one step, then one token per step), so the state it saves at its
end must be the same bytes, and a next turn resumed from either must compute the same thing (`==`).
"""

from __future__ import annotations

import re

import pytest

from testkit.prompts import prompt
from tests.vllm_engine.conftest import start_cache_server
from tests.vllm_engine.gates import assert_same_computation


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    server = start_cache_server(tmp_path_factory, "disk-sync", host="256MiB", disk="256MiB")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def asynchronous(four_layer, cache_server):
    return four_layer.start("async", cache_server.url, async_scheduling=True)


def test_a_turn_that_stops_under_async_scheduling_is_saved_at_its_end(four_layer, asynchronous, second_server):
    n = four_layer.n
    synchronous = four_layer.start("sync", second_server.url)
    system = prompt(700, n + 40)
    free = asynchronous.one(system, max_tokens=40).tokens
    stop = free[25]
    turn_one = asynchronous.one(system, max_tokens=40, stop_token_ids=[stop])
    assert turn_one.finish == "stop" and turn_one.tokens == free[:free.index(stop) + 1]
    reply = turn_one.tokens
    turn_two = system + reply + prompt(701, n + 44)
    # The engine holds its own prefix cache only up to the block boundary: the turn's end comes from tiercache. Whether
    # the step in flight fed the stop token before the request ended depends on when the scheduler saw the stop (the
    # batch queue's timing): the request ends with its stop token computed, or one token before it.
    resumed = asynchronous.one(turn_two, max_tokens=16)
    computed = resumed.cached - len(system)
    assert computed in (len(reply), len(reply) - 1), f"resumed at {resumed.cached}, the turn ended at " \
        f"{len(system) + len(reply)} tokens"
    assert asynchronous.stats()["loaded_tokens"] >= resumed.cached - n
    # The yardstick computes the same tokens the same way and stops by length one token later (its last token
    # sampled, not fed), so it saves the end at the same position; the next turn resumed from there must be equal.
    assert synchronous.one(system, max_tokens=computed + 1).tokens[:computed] == reply[:computed]
    yardstick = synchronous.one(turn_two, max_tokens=16)
    assert_same_computation(resumed, yardstick, "the next turn after an async-scheduled stop")


def test_the_connectors_start_line_is_in_vllms_log(asynchronous, cache_server):
    """docs/first-deployment.md's first check: vLLM's log shows the connector's start line, in vLLM's format."""
    lines = asynchronous.log_path.read_text(errors="replace").splitlines()
    starts = [line for line in lines if f"TierCacheConnector (SCHEDULER) on {cache_server.url}" in line]
    assert starts, "the connector's start line is not in vLLM's log"
    assert re.match(r"^(\(\w+ pid=\d+\) )?INFO \d\d-\d\d \d\d:\d\d:\d\d \[connector\.py:\d+\] ", starts[0]), starts[0]
