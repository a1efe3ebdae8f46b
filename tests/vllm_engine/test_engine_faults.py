"""The 4-layer model (N = 256 with AVX-512 BF16, 128 without) under the heavier cases: a 16K-token shared document,
preemption under a small KV cache, loads that fail, and a cache server that dies or hangs mid-run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from testkit.prompts import prompt
from tests.helpers import ServerProcess, wait_for
from tests.vllm_engine.gates import assert_finite, assert_same_bytes, assert_same_computation
from tiercache.client import Client

DOCUMENT_TOKENS = 16 * 1024 + 100


@pytest.fixture(scope="module")
def alone(four_layer):
    return four_layer.start("alone", None)


def test_a_long_document_asked_from_a_second_engine_hits_its_blocks(four_layer, cache_server, alone):
    n = four_layer.n
    document = prompt(500, DOCUMENT_TOKENS)
    questions = [prompt(501 + i, 40 + 7 * i) for i in range(3)]
    first = four_layer.start("doc-first", cache_server.url)
    first.one(document + questions[0])
    alone.one(document + questions[0])
    second = four_layer.start("doc-second", cache_server.url)
    for i, question in enumerate(questions[1:], start=1):
        own = alone.one(document + question)
        assert own.cached == DOCUMENT_TOKENS // n * n, f"question {i}: vLLM's own hit is {own.cached}"
        resumed = second.one(document + question)
        assert_same_bytes(resumed, own, f"question {i} in the second engine")
        assert_same_computation(resumed, own, f"question {i} in the second engine")
    # The first question's blocks came from tiercache; the second one's from the engine's own prefix cache.
    assert second.stats()["loaded_tokens"] == DOCUMENT_TOKENS // n * n


def test_preempted_requests_finish_with_the_results_of_an_unpressed_engine(four_layer, cache_server, alone):
    """Four long requests at once in a KV cache that holds about two: vLLM preempts and resumes; with the connector
    a resumed request reloads what it had saved. Every request ends with finite logprobs and the same tokens as
    each prompt run alone in an engine with room to spare."""
    small = four_layer.start("small-cache", cache_server.url, kv_cache_memory_bytes=6 << 20, max_num_seqs=4,
                             max_model_len=2048)
    prompts = [prompt(600 + i, 3 * four_layer.n + 17 * i) for i in range(4)]
    results = small.generate(prompts, max_tokens=24)
    for i, (tokens, got) in enumerate(zip(prompts, results)):
        assert_finite(got, f"request {i}")
        # Tokens only: a request resumed after preemption computes in other steps than any run alone can repeat.
        assert got.tokens == alone.one(tokens, max_tokens=24).tokens, f"request {i}: other tokens than vLLM alone"
    stats = small.stats()
    assert stats["loads_failed"] == 0


def _corrupt_every_chunk_file(disk: Path) -> int:
    count = 0
    for path in disk.rglob("*.chunk"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # the payload's last byte: the record's checksum no longer matches
        path.write_bytes(bytes(data))
        count += 1
    return count


def test_a_load_that_fails_recomputes_to_the_cold_result(four_layer, alone, tmp_path):
    """The server finds the objects at lookup time but every one of them fails its checksum when the worker reads
    it (the record is corrupted on disk between lookup and load): the load fails as a whole and vLLM recomputes."""
    server = ServerProcess("--host-mem", "0", "--disk-dir", str(tmp_path), "--disk-size", "1GiB").start()
    try:
        tokens = prompt(700, 2 * four_layer.n + 70)
        four_layer.start("failing-producer", server.url).one(tokens)
        assert _corrupt_every_chunk_file(tmp_path) > 0
        consumer = four_layer.start("failing-consumer", server.url)
        got = consumer.one(tokens)
        stats = consumer.stats()
        # Planned, failed, and counted as failed: nothing delivered (the server's counters say the same).
        assert stats["loads_failed"] == 1 and stats["load_tokens_planned"] > 0 and stats["loaded_tokens"] == 0
        assert stats["failed_load_tokens"] == stats["load_tokens_planned"]
        wait_for(lambda: _delivered(server)["failed_loads"] == 1, timeout_s=60, what="the failed load reported")
        assert sum(_delivered(server)["loaded_tokens_by_tier"].values()) == 0
        assert got.cached == 0
        assert_same_computation(got, _cold(alone, tokens), "recomputed after a failed load")
    finally:
        server.kill()


def _delivered(server) -> dict:
    with Client.from_url(server.url) as client:
        return client.stats()["delivered"]


def test_only_what_the_engine_loaded_counts_as_delivered(four_layer, tmp_path):
    """The same prompt twice in one engine is vLLM's own hit: a lookup finds it in tiercache too, but nothing is
    loaded, and the server says so (found, not delivered). A fresh engine then loads it: delivered, counted by the
    connector and by the server alike."""
    server = ServerProcess("--host-mem", "256MiB", "--disk-size", "0").start()
    try:
        n = four_layer.n
        tokens = prompt(710, 2 * n + 44)
        engine = four_layer.start("own-hit", server.url)
        engine.one(tokens)
        again = engine.one(tokens)
        assert again.cached >= 2 * n, "vLLM's own prefix cache did not hit"
        assert engine.stats()["loaded_tokens"] == 0
        with Client.from_url(server.url) as client:
            wait_for(lambda: client.stats()["lookups"]["lookups"] >= 2, timeout_s=60, what="both lookups counted")
            found = sum(client.stats()["lookups"]["found_tokens_by_tier"].values())
        assert found >= 2 * n, "the second lookup found the prompt in tiercache"
        assert _delivered(server)["loads"] == 0 and sum(_delivered(server)["loaded_tokens_by_tier"].values()) == 0
        fresh = four_layer.start("fresh-load", server.url)
        got = fresh.one(tokens)
        loaded = fresh.stats()["loaded_tokens"]
        assert loaded == got.cached > 0
        wait_for(lambda: _delivered(server)["loads"] == 1, timeout_s=60, what="the fresh engine's load reported")
        assert _delivered(server)["loaded_tokens_by_tier"] == {"host": loaded}
    finally:
        server.kill()


def _cold(alone, tokens):
    """vLLM alone computing `tokens` from scratch (a prompt it has not seen: the first run is cold)."""
    cold = alone.one(tokens)
    assert cold.cached == 0, f"vLLM alone hit {cold.cached} tokens: not a cold run"
    return cold


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_requests_complete_when_the_cache_server_dies_or_hangs(four_layer, alone, tmp_path, fault):
    server = ServerProcess("--host-mem", "256MiB", "--disk-size", "0").start()
    engine = four_layer.start(f"server-{fault}", server.url)
    try:
        engine.one(prompt(800, 300))
        if fault == "killed":
            server.kill()
        else:
            os.kill(server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        for i in range(3):
            tokens = prompt((810 if fault == "killed" else 820) + i, 200 + 50 * i)
            assert_same_computation(engine.one(tokens), _cold(alone, tokens), f"request {i}")
        # Lookups fail fast (one 0.5 s deadline, then instant misses while the breaker is open); saves wait on worker
        # threads.
        assert time.monotonic() - started < 60
    finally:
        if fault == "hung":
            os.kill(server.process.pid, signal.SIGCONT)
        server.kill()


def test_prompts_given_as_embeddings_are_never_looked_up_or_saved(four_layer, cache_server):
    engine = four_layer.start("embeds", cache_server.url, enable_prompt_embeds=True)
    before = engine.stats()
    for _ in range(2):
        assert_finite(engine.one_from_embeddings(seed=900, length=300, max_tokens=4), "embeddings prompt")
    after = engine.stats()
    assert (after["lookups"], after["saves_planned"], after["objects_saved"]) == \
        (before["lookups"], before["saves_planned"], before["objects_saved"])


def test_other_weights_under_the_same_path_and_name_share_nothing(four_layer, cache_server, tmp_path):
    """Two checkpoints served from one path under one name: the namespace names the weights, not the path."""
    shared_name = {"connector_extra": {"model_name": "tiny-shared-name"}}
    tokens = prompt(950, 300)
    path = tmp_path / "model"
    four_layer.model.write_to(path)
    four_layer.start("weights-a", cache_server.url, path=str(path), **shared_name).one(tokens)
    four_layer.model.write_to(path, seed=7)  # another checkpoint replaces the first at the same path
    assert four_layer.start("weights-b", cache_server.url, path=str(path), **shared_name).one(tokens).cached == 0
    # The first checkpoint's files at another path are the same weights: they share.
    other = tmp_path / "elsewhere"
    four_layer.model.write_to(other)
    reused = four_layer.start("weights-a-elsewhere", cache_server.url, path=str(other), **shared_name).one(tokens)
    assert reused.cached == 288
