"""A hybrid model (Qwen3-Next: Gated-DeltaNet and attention layers) on SGLang's real CPU engine with HiCache and
TierCacheStorage: a multi-turn conversation's extension hit, KV pages and the Mamba state, read by a fresh engine
from a real `tiercache serve`.

SGLang on the CPU runs hybrids with page size 1 and the no_buffer Mamba strategy (it refuses extra_buffer there):
the Mamba state is cached at a request's end, so the hit is the next turn's: the previous prompt and its output but
the last token. The yardstick is SGLang's own L3 hit, a fresh engine reading the same conversation from its file
backend (HiCacheFile): the same cached tokens (device, host, storage), the same objects stored, the same logprobs
bit for bit. SGLang code run: UnifiedRadixCache with its Mamba component, the hybrid HiCache controller (KV pages
through v1, Mamba states through v2: `register_mem_host_pool_v2`, `batch_exists_v2`, `batch_get_v2`,
`batch_set_v2`), the Mamba host pool, the `direct` io backend and the `page_first_direct` layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from tests.sglang_engine.conftest import prompt
from tests.sglang_engine.engines import Completion, EngineProcess, engine_settings, file_pages, server_pages
from tests.sglang_engine.models import HYBRID, transformers_greedy

FIRST = prompt(11, 100)
OUTPUT = 4
NEW = prompt(12, 10)  # the user's next message
HIT = len(FIRST) + OUTPUT - 1  # the previous turn without its last token: the state SGLang cached at its end


@pytest.fixture(scope="module")
def model(models_dir):
    return HYBRID.write(models_dir)


def start(model: str, logs: Path, name: str, **settings) -> EngineProcess:
    return EngineProcess(engine_settings(model, page_size=1, hybrid=True, **settings), logs / f"hybrid-{name}.log")


class Conversation(NamedTuple):
    first: Completion  # turn 1, computed cold
    second: list[int]  # turn 2's prompt: turn 1, its output, a new message
    own: Completion  # turn 2 on the engine that computed turn 1: SGLang's own (device) extension hit


def two_turns(engine: EngineProcess) -> Conversation:
    """Engine A's part: turn 1 cold, turn 2 an extension hit on the engine's own cache, then flush_cache (it returns
    once every backup is in storage)."""
    first = engine.generate(FIRST, max_new_tokens=OUTPUT)
    assert first.cached == 0, f"a cold engine hit {first.cached} tokens"
    second = FIRST + first.tokens + NEW
    own = engine.generate(second, max_new_tokens=OUTPUT, logprob_start_len=HIT)
    assert (own.cached, own.details["device"]) == (HIT, HIT), f"SGLang's own hit: {own.details}"
    engine.flush()
    return Conversation(first, second, own)


class FileBackend(NamedTuple):
    conversation: Conversation
    kv_pages: int  # objects SGLang's file backend stored: KV pages (page size 1: one a token) and Mamba states
    states: int
    fresh: Completion  # a fresh engine's turn 2, read from the file backend: SGLang's own L3 hit


@pytest.fixture(scope="module")
def file_backend(model, logs, tmp_path_factory) -> FileBackend:
    directory = tmp_path_factory.mktemp("hicache-file")
    writer = start(model, logs, "file-a", storage="file", file_dir=str(directory))
    try:
        conversation = two_turns(writer)
    finally:
        writer.close()
    reader = start(model, logs, "file-b", storage="file", file_dir=str(directory))
    try:
        fresh = reader.generate(conversation.second, max_new_tokens=OUTPUT, logprob_start_len=HIT)
    finally:
        reader.close()
    assert fresh.storage_backend == "HiCacheFile" and fresh.storage == HIT, fresh.details
    return FileBackend(conversation, file_pages(directory), file_pages(directory, "mamba"), fresh)


def test_sglangs_cpu_engine_computes_what_transformers_computes(model, file_backend):
    """The harness's stand-ins for SGLang's kernels (gated delta rule, causal conv1d, gating, the gated norm, the
    shared-expert gate) are right: SGLang's cold turn 1 is transformers' greedy decoding of the same model, within
    bf16 rounding (measured: 1e-4; a delta rule without its decay picks other tokens)."""
    reference = transformers_greedy(model, FIRST, OUTPUT)
    first = file_backend.conversation.first
    assert first.tokens == [token for token, _ in reference]
    worst = max(abs(logprob - expected) for (logprob, _), (_, expected) in zip(first.output, reference))
    assert worst < 0.02, f"SGLang's logprobs differ from transformers' by {worst:.4f}"


def test_a_fresh_engine_reads_a_conversation_from_tiercache_as_from_sglangs_file_backend(server, model, logs,
                                                                                       file_backend):
    file_conversation, file_fresh = file_backend.conversation, file_backend.fresh
    second = file_conversation.second
    a = start(model, logs, "a", storage="tiercache", url=server.url, extra={"interface_v1": 1})
    try:
        conversation = two_turns(a)
    finally:
        a.close()
    assert conversation.second == second
    assert conversation.own.same_computation() == file_conversation.own.same_computation()
    assert file_backend.states > 0
    assert server_pages(server.url, Path(model).name) == file_backend.kv_pages + file_backend.states, \
        f"SGLang's file backend stored {file_backend.kv_pages} KV pages and {file_backend.states} Mamba states"

    b = start(model, logs, "b", storage="tiercache", url=server.url, extra={"interface_v1": 1})
    try:
        got = b.generate(second, max_new_tokens=OUTPUT, logprob_start_len=HIT)
    finally:
        b.close()

    assert got.details == {**file_fresh.details, "storage_backend": "TierCacheStorage"}, \
        f"TierCacheStorage: {got.details}; SGLang's file backend: {file_fresh.details}"
    assert got.same_computation() == file_fresh.same_computation(), \
        "engine B's logprobs differ from SGLang's own L3 hit"
