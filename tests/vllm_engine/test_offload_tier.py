"""tiercache as a secondary tier of vLLM's own KV offloading, on vLLM's real CPU engine, configured as a user would:
`OffloadingConnector` with `TieringOffloadingSpec`, the user's `secondary_tiers` entry from `tiercache vllm-tier`,
vLLM's offloading worker with its four CUDA-only points stood in (testkit.offload_worker).

Engines (the hybrid model; the dense one repeats the restart case in test_offload_tier_dense.py):
- `alone`: vLLM without offloading, the yardstick (its own prefix cache, warmed so that it hits where the tier does);
- `first`: offloads every prompt to tiercache and to vLLM's own `fs` tier (the same cascades);
- `replica`: a second engine beside `first`; `fs_replica`: a second engine with vLLM's `fs` tier only;
- `restarted`: an engine started after `first` exited.
Every hit from the tier is asserted exactly, from vLLM's own counter of prompt tokens by source (a recompute
would count none), with the gates of the other engine tests: the engine's bytes and its outputs, by `==`.
The tier restores whole chunks of the prompt only: vLLM offloads partial tails only from its CPU pool (below), and
decode tokens only with `offload_prompt_only` false (the chat case).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from testkit.prompts import prompt
from testkit.vllm_models import FOUR_LAYER
from tests.helpers import ServerProcess
from tests.vllm_engine.conftest import Engines, start_cache_server
from tests.vllm_engine.gates import assert_same_bytes, assert_same_computation
from tests.vllm_engine.offload_runs import EXTERNAL, OffloadEngines, assert_restored, counted
from tiercache.cli.vllm_tier import tier_entry

PROMPTS = {name: 500 + i for i, name in enumerate(["restore", "restart", "tail", "chat", "vanish", "swap", "flip"])}
# A store or load waits this long on a server that does not answer (SIGSTOP) before it fails: short here, so that a
# settled engine is not kept waiting on one (the default is 30 s).
TIER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def run(models_dir, tmp_path_factory):
    server = start_cache_server(tmp_path_factory, "offload-tier")
    engines = Engines(FOUR_LAYER, models_dir, tmp_path_factory.mktemp("engine-logs"))
    tier = {**tier_entry(engines.path, [], server.url), "timeout_s": TIER_TIMEOUT_S}
    made = OffloadEngines(engines, tier, tmp_path_factory.mktemp("fs-tier"))
    servers = [server]
    yield made, servers
    made.close()
    for each in servers:
        each.kill()


def long_prompt(n: int, name: str) -> list[int]:
    """Three whole chunks and most of a fourth: L = 4N - 24 (its 16 generated tokens stay in the fourth chunk)."""
    return prompt(PROMPTS[name], 4 * n - 24)


def test_the_first_engine_computes_as_vllm_alone_and_offloads_to_both_tiers(run):
    made, _ = run
    n = made.n
    for name in PROMPTS:
        tokens = long_prompt(n, name) if name != "chat" else prompt(PROMPTS[name], n + 40)
        max_tokens = 3 * n - len(tokens) + 1 if name == "chat" else 16  # the chat's turn 1 ends at 3N (below)
        offloaded = made.first.one(tokens, max_tokens=max_tokens)
        if name in ("restore", "chat"):  # offloading changes nothing the engine computes (once is enough)
            assert_same_computation(offloaded, made.alone_cold(tokens, max_tokens=max_tokens), f"{name}: first engine")
    tier = made.first.offload_stats()["tiers"]
    assert [t["type"] for t in tier] == ["TierCacheTier", "fs"]
    assert tier[0]["stored_chunks"] > 0 and tier[0]["store_failures"] == 0


def test_a_second_engine_restores_what_the_first_offloaded_exactly(run):
    made, _ = run
    n = made.n
    tokens = long_prompt(n, "restore")
    assert_restored(made.replica, tokens, made.alone_hit_at(tokens, 3 * n), EXTERNAL, "second engine")


def test_vllms_own_fs_tier_resumes_at_the_same_position(run):
    made, _ = run
    n = made.n
    got, hits = counted(made.fs_replica, long_prompt(n, "restore"))
    assert got.cached == 3 * n and hits == {"disk": 3 * n}, f"fs tier: hit {got.cached}, vLLM counted {hits}"


def test_a_restarted_engine_restores_what_the_first_offloaded_and_nothing_is_left_in_dev_shm(run):
    made, _ = run
    n = made.n
    made.first.close()
    assert made.first.pool_file is not None and not made.first.pool_file_left
    tokens = long_prompt(n, "restart")
    assert_restored(made.restarted, tokens, made.alone_hit_at(tokens, 3 * n), EXTERNAL, "restarted engine")


def test_a_repeated_prompt_resumes_at_vllms_partial_tail_from_its_cpu_pool(run):
    """With --prefix-match-unit 16 vLLM resumes a repeated hybrid prompt at the last 16-token boundary: after its
    own prefix cache is reset, from the partial tail its CPU pool kept (the tier, which got whole chunks, is not
    needed)."""
    made, _ = run
    n = made.n
    tokens = long_prompt(n, "tail")
    made.restarted.one(tokens)
    made.restarted.reset_prefix_cache()
    tail = (len(tokens) - 1) // 16 * 16
    assert_restored(made.restarted, tokens, made.alone_hit_at(tokens, tail), "host", "partial tail")


def test_a_chat_resumes_at_the_last_whole_chunk_of_the_reply_with_offload_prompt_only_false(run):
    """Turn 1 (N + 40 prompt tokens) ran in `first` with a reply that ends at 3N computed tokens: its decode KV was
    offloaded in whole chunks (offload_prompt_only false), so turn 2 resumes at 3N in another engine."""
    made, _ = run
    n = made.n
    system = prompt(PROMPTS["chat"], n + 40)
    # The yardstick runs turn 1 too: a state computed token by token (decode) is not the one a prefill computes.
    reply = made.alone_cold(system, max_tokens=3 * n - len(system) + 1).tokens
    turn_two = system + reply + prompt(PROMPTS["chat"] + 1, n + 20)
    own = made.alone.one(turn_two)
    assert own.cached == 3 * n, f"vLLM's own hit for turn 2 is {own.cached}"
    assert_restored(made.restarted, turn_two, own, EXTERNAL, "turn 2")


def test_an_object_that_vanished_after_the_lookup_is_recomputed_and_not_offered_again(run):
    made, _ = run
    n = made.n
    tokens = long_prompt(n, "vanish")
    before = made.restarted.offload_stats()
    earlier = made.restarted.plant("vanish")
    try:
        got, hits = counted(made.restarted, tokens)
    finally:
        planted = made.restarted.plant(None)
    after = made.restarted.offload_stats()
    assert got.cached == 0 and hits == {}, f"hit {got.cached} after the tier lost it, vLLM counted {hits}"
    assert_same_computation(got, made.alone_cold(tokens), "recomputed after a failed load")
    # Every promotion failed, and no key was offered for a load again (no livelock). vLLM may promote the chunks in
    # one job or in two (the tier's answers can reach it over two steps), so keys are counted, not jobs.
    vanished = planted["vanished"][len(earlier["vanished"]):]
    jobs = planted["planted"] - earlier["planted"]
    assert vanished and len(set(vanished)) == len(vanished), f"keys loaded more than once: {vanished}"
    assert made.promotion_failures(after) - made.promotion_failures(before) == jobs >= 1
    tier_before, tier_after = before["tiers"][0], after["tiers"][0]
    assert tier_after["load_failures"] - tier_before["load_failures"] == len(vanished)
    assert tier_after["loaded_chunks"] == tier_before["loaded_chunks"]


@pytest.mark.parametrize("fault", ["swap", "flip"])
def test_the_bytes_gate_fails_on_a_fault_planted_in_the_tiers_loads(run, fault):
    made, _ = run
    n = made.n
    tokens = long_prompt(n, fault)
    made.restarted.plant(fault)
    try:
        got, _ = counted(made.restarted, tokens)
    finally:
        made.restarted.plant(None)
    assert got.cached == 3 * n
    with pytest.raises(AssertionError, match="hold other bytes"):
        assert_same_bytes(got, made.alone_hit_at(tokens, 3 * n), f"planted {fault}")


def test_a_dead_stopped_or_restarted_server_costs_no_request_and_never_holds_the_scheduler(run):
    """Every request completes, computed as vLLM alone computes it; the scheduler's lookups in the tier never wait on
    the server; and once the server is back, the engine offloads to it again without a restart (a second engine
    restores what it offloaded then)."""
    made, servers = run
    n = made.n
    engine = made.restarted
    server = servers[0]
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        stopped = prompt(600, 2 * n + 5)
        assert_same_computation(engine.one(stopped), made.alone_cold(stopped), "server stopped")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    server.kill()
    dead = prompt(601, 2 * n + 5)
    assert_same_computation(engine.one(dead), made.alone_cold(dead), "server dead")
    servers.append(ServerProcess(*server.args[2:], port=server.port).start())  # the same flags, port and disk
    offloaded = _offload_until_stored(engine, n)
    got, hits = counted(made.replica, offloaded)
    assert got.cached == 3 * n and hits == {EXTERNAL: 3 * n}, f"after the restart: hit {got.cached}, {hits}"
    delays = engine.offload_stats()["lookup_sync_delay"]["1:TierCacheTier"]
    # A Python call can wait for the interpreter's lock up to its switch interval (5 ms) on a loaded machine: all
    # but a few lookups stay under 1 ms, and none waited on the server (its deadline is 0.5 s).
    assert delays["buckets"]["0.001"] >= 0.95 * delays["count"] and delays["buckets"]["0.05"] == delays["count"], \
        f"the tier's lookups held vLLM's scheduler: {delays}"


def _offload_until_stored(engine, n: int, timeout_s: float = 60) -> list[int]:
    """New prompts until one is stored whole in the server (the client's breaker finds the server back within its
    probe interval; stores before that fail, counted): that prompt."""
    deadline = time.monotonic() + timeout_s
    for seed in range(700, 800):
        before = engine.offload_stats()["tiers"][0]
        tokens = prompt(seed, 4 * n - 24)
        engine.one(tokens)
        after = engine.offload_stats()["tiers"][0]
        if after["stored_chunks"] > before["stored_chunks"] and after["store_failures"] == before["store_failures"]:
            return tokens
        assert time.monotonic() < deadline, f"the engine stored nothing in the restarted server: {after}"
    raise AssertionError("no prompt stored")
