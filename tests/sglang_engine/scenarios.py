"""The two restores the real-engine tests judge, each built once per session (the session fixtures dense_scenario and
hybrid_scenario in conftest.py; engine starts are most of the suite's time): test_dense.py and test_hybrid.py judge
them, test_planted_faults.py plants faults in the same reader engines.

A scenario runs SGLang's own file backend (HiCacheFile) and tiercache side by side, writers started together, then
readers started together:
- a writer computes the prompt cold, then SGLang's own device hit at the judged position (dense: the prompt again;
  hybrid: the second turn of a conversation, an extension hit), then flush_cache (it returns once every backup is in
  storage) and exits;
- a fresh reader (a new process) makes the judged request: the hit is read from storage (tiercache, or the file
  backend: SGLang's own L3 hit). The tiercache reader stays up for the fault runs; for the hybrid, the file reader
  then computes the judged prompt cold once more (its files removed: a storage miss), the recomputation the hybrid
  tests compare the hit with.
Every judged request asks for OUTPUT_TOKENS tokens, top-20 logprobs, prompt logprobs from the hit's end, and the
engine's bytes (gates.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testkit.prompts import prompt
from testkit.sglang_engine import Completion, EngineProcess, engine_settings, start_together
from testkit.sglang_models import DENSE, HYBRID
from tests.sglang_engine.gates import OUTPUT_TOKENS
from tests.sglang_engine.stored import file_pages, server_pages

# Dense (Qwen3), page size 16: 12 full pages and 8 tokens; the hit is at most 192 tokens, the engine computes the rest.
DENSE_PAGE = 16
DENSE_PROMPT = prompt(7, 200)
DENSE_HIT = len(DENSE_PROMPT) // DENSE_PAGE * DENSE_PAGE

# Hybrid (Qwen3-Next), page size 1, no_buffer: the Mamba state is cached at a request's end, so the hit is the next
# turn's: the previous prompt and its output but the last token (the state SGLang cached).
FIRST = prompt(11, 100)
FIRST_OUTPUT = 4
NEW = prompt(12, 10)  # the user's next message
HYBRID_HIT = len(FIRST) + FIRST_OUTPUT - 1


@dataclass(frozen=True)
class Written:
    """What a writer computed before it flushed everything to storage."""
    cold: Completion  # dense: the prompt, cold; hybrid: turn 1, cold (its end state is what turn 2 hits)
    own: Completion  # SGLang's own device hit at the judged position, the reference of both gates


@dataclass(frozen=True)
class Scenario:
    kind: str  # "dense" or "hybrid"
    model: str
    prompt: list[int]  # the judged prompt
    hit_tokens: int
    tiercache: Written
    file: Written
    server_objects: int  # what the tiercache writer backed up: KV pages (and Mamba states)
    file_objects: tuple[int, int]  # what the file writer backed up: (KV pages, Mamba states)
    restored: Completion  # the judged request: a fresh engine's hit from tiercache
    file_restored: Completion  # the same from SGLang's file backend: SGLang's own L3 hit
    recomputed: Completion | None  # hybrid: the judged prompt computed cold (no hit)
    reader: EngineProcess  # the tiercache reader, still up

    def request(self, engine: EngineProcess) -> Completion:
        """The judged request, on any engine."""
        return judged_request(engine, self.prompt, self.hit_tokens)


def judged_request(engine: EngineProcess, tokens: list[int], hit_tokens: int) -> Completion:
    return engine.generate(tokens, max_new_tokens=OUTPUT_TOKENS, logprob_start_len=hit_tokens, engine_bytes=True)


def _write_dense(engine: EngineProcess) -> tuple[list[int], Written]:
    cold = judged_request(engine, DENSE_PROMPT, DENSE_HIT)
    assert cold.cached == 0, f"a cold engine hit {cold.cached} tokens"
    own = judged_request(engine, DENSE_PROMPT, DENSE_HIT)
    assert (own.cached, own.details["device"]) == (DENSE_HIT, DENSE_HIT), f"SGLang's own hit: {own.details}"
    return DENSE_PROMPT, Written(cold, own)


def _write_hybrid(engine: EngineProcess) -> tuple[list[int], Written]:
    first = engine.generate(FIRST, max_new_tokens=FIRST_OUTPUT, engine_bytes=True)
    assert first.cached == 0, f"a cold engine hit {first.cached} tokens"
    second = FIRST + first.tokens + NEW  # turn 2: turn 1, its output, the user's next message
    own = judged_request(engine, second, HYBRID_HIT)
    assert (own.cached, own.details["device"]) == (HYBRID_HIT, HYBRID_HIT), f"SGLang's own hit: {own.details}"
    return second, Written(first, own)


def build(kind: str, models_dir: Path, server_url: str, logs: Path, file_dir: Path) -> Scenario:
    """Writers, then readers, each pair started together; returns with the tiercache reader up."""
    hybrid = kind == "hybrid"
    model = (HYBRID if hybrid else DENSE).write(models_dir)
    page_size = 1 if hybrid else DENSE_PAGE
    hit = HYBRID_HIT if hybrid else DENSE_HIT
    def settings(storage: str) -> dict:
        return engine_settings(model, page_size=page_size, hybrid=hybrid, storage=storage, url=server_url,
                               file_dir=str(file_dir), extra={"interface_v1": 1} if storage == "tiercache" else None)

    def pair(role: str) -> list[EngineProcess]:
        return start_together(*((settings(storage), logs / f"{kind}-{storage}-{role}.log")
                                for storage in ("tiercache", "file")))

    writers = pair("writer")
    try:
        (tokens, written), (file_tokens, file_written) = ((_write_hybrid if hybrid else _write_dense)(writer)
                                                          for writer in writers)
        assert tokens == file_tokens, "the writers' first turns differ"
        for writer in writers:
            writer.flush()
    finally:
        for writer in writers:
            writer.close()
    server_objects = server_pages(server_url, Path(model).name)
    file_objects = (file_pages(file_dir), file_pages(file_dir, "mamba"))

    reader, file_reader = pair("reader")
    try:
        restored, file_restored = (judged_request(engine, tokens, hit) for engine in (reader, file_reader))
        recomputed = None
        if hybrid:
            file_reader.flush()  # its backups done, its device and host caches emptied
            for page in file_dir.glob("*.bin"):  # and its storage: nothing left to hit
                page.unlink()
            recomputed = judged_request(file_reader, tokens, hit)
            assert recomputed.cached == 0, recomputed.details
    except BaseException:
        reader.close()
        raise
    finally:
        file_reader.close()
    return Scenario(kind, model, tokens, hit, written, file_written, server_objects, file_objects, restored,
                    file_restored, recomputed, reader)
