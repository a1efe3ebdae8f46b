"""A dense model (Qwen3) on SGLang's real CPU engine with HiCache and TierCacheStorage (v1: pages straight between
SGLang's host pool and the server): engine A computes a prompt and backs its pages up; a fresh engine B, a new
process, finds them on a real `tiercache serve`.

The yardsticks are SGLang's own: B's logprobs equal A's own hit on the same prompt, bit for bit (the same SGLang
computation on the same KV), and B's cached tokens equal what SGLang's own file backend (HiCacheFile) gives a fresh
engine in the same scenario. SGLang code run: the HiCache controller (write-through to the host pool, backup to
storage, storage prefetch with the wait_complete policy, load back to the device), the `direct` io backend, the
`page_first_direct` host layout, UnifiedRadixCache, flush_cache (which waits for the backups in flight).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_engine.conftest import prompt
from tests.sglang_engine.engines import EngineProcess, engine_settings, file_pages, server_pages
from tests.sglang_engine.models import DENSE, transformers_greedy

PAGE = 16
LENGTH = 200  # 12 full pages and 8 tokens: a hit is at most 192 tokens, the engine computes the rest
FULL_PAGES = LENGTH // PAGE
HIT = FULL_PAGES * PAGE
TOKENS = prompt(7, LENGTH)


@pytest.fixture(scope="module")
def model(models_dir):
    return DENSE.write(models_dir)


def start(model: str, logs: Path, name: str, **settings) -> EngineProcess:
    return EngineProcess(engine_settings(model, page_size=PAGE, **settings), logs / f"dense-{name}.log")


def generate(engine: EngineProcess):
    """TOKENS with their uncached tail's prompt logprobs (SGLang matches a prefix only up to where prompt logprobs
    start: from HIT, the whole hit stays possible) and four generated tokens' top-20 logprobs."""
    return engine.generate(TOKENS, max_new_tokens=4, logprob_start_len=HIT)


def write_and_hit(engine: EngineProcess):
    """Engine A's part: a cold computation, the engine's own hit on the same prompt, then SGLang's flush_cache,
    which returns once every backup the engine started is in storage. Returns (cold, own hit)."""
    cold = generate(engine)
    assert cold.cached == 0, f"a cold engine hit {cold.cached} tokens"
    own = generate(engine)
    assert (own.cached, own.details["device"]) == (HIT, HIT), f"SGLang's own hit: {own.details}"
    engine.flush()
    return cold, own


@pytest.fixture(scope="module")
def file_backend(model, logs, tmp_path_factory):
    """SGLang's own file backend in the same scenario: (engine A's cold computation and own hit, a fresh engine B's
    storage hit)."""
    directory = tmp_path_factory.mktemp("hicache-file")
    writer = start(model, logs, "file-a", storage="file", file_dir=str(directory))
    try:
        cold, own = write_and_hit(writer)
    finally:
        writer.close()
    assert file_pages(directory) == FULL_PAGES
    reader = start(model, logs, "file-b", storage="file", file_dir=str(directory))
    try:
        fresh = generate(reader)
    finally:
        reader.close()
    assert fresh.storage_backend == "HiCacheFile" and fresh.storage > 0, fresh.details
    return cold, own, fresh


def test_sglangs_cpu_engine_computes_what_transformers_computes(model, file_backend):
    """SGLang's CPU engine with the harness (its sgl_kernel stand-in writes the request-to-token table) computes the
    model as transformers does: the same greedy tokens, logprobs within bf16 rounding."""
    cold = file_backend[0]
    reference = transformers_greedy(model, TOKENS, len(cold.tokens))
    assert cold.tokens == [token for token, _ in reference]
    worst = max(abs(logprob - expected) for (logprob, _), (_, expected) in zip(cold.output, reference))
    assert worst < 0.02, f"SGLang's logprobs differ from transformers' by {worst:.4f}"


def test_a_fresh_engine_reads_the_prefix_from_tiercache_as_from_sglangs_file_backend(server, model, logs,
                                                                                   file_backend):
    a = start(model, logs, "a", storage="tiercache", url=server.url, extra={"interface_v1": 1})
    try:
        _, own = write_and_hit(a)
    finally:
        a.close()
    assert server_pages(server.url, Path(model).name) == FULL_PAGES

    b = start(model, logs, "b", storage="tiercache", url=server.url, extra={"interface_v1": 1})
    try:
        got = generate(b)
    finally:
        b.close()

    _, file_own, file_fresh = file_backend
    assert got.storage_backend == "TierCacheStorage", got.details
    assert got.details == {**file_fresh.details, "storage_backend": "TierCacheStorage"}, \
        f"TierCacheStorage: {got.details}; SGLang's file backend: {file_fresh.details}"
    assert got.storage == HIT
    assert got.same_computation() == own.same_computation(), "engine B's logprobs differ from engine A's own hit"
    # The file backend's fresh engine computes the same (both equal SGLang's own hit, which is the same on both).
    assert file_fresh.same_computation() == file_own.same_computation() == own.same_computation()
