"""A dense model (Qwen3) on SGLang's real CPU engine with HiCache and TierCacheStorage (v1: pages straight between
SGLang's host pool and the server): a writer computes a 200-token prompt (page size 16) and backs its pages up; a
fresh engine, a new process, restores the 12 full pages from a real `tiercache serve` (scenarios.py).

Both gates (gates.py) judge the restore against SGLang's own device hit at the same position, by ==: 16 generated
tokens with their logprobs and top-20 logprobs, the prompt logprobs of the 8 tokens computed after the hit, and every
KV page of the request as SGLang's device pool holds it. The hit is what recomputation gives (the writer's cold run,
both gates), and the cached tokens are what SGLang's own file backend (HiCacheFile) gives a fresh engine. SGLang code
run: the HiCache controller (write-through to the host pool, backup to storage, storage prefetch with the
wait_complete policy, load back to the device), the `direct` io backend, the `page_first_direct` host layout,
UnifiedRadixCache, flush_cache (which waits for the backups in flight).
"""

from __future__ import annotations

import pytest

from testkit.sglang_models import transformers_greedy
from tests.sglang_engine.gates import assert_exact
from tests.sglang_engine.scenarios import DENSE_HIT, DENSE_PAGE, DENSE_PROMPT

# The first test to ask for a scenario builds it (scenarios.py: two pairs of engine starts, up to 300 s each, and a
# dozen requests): more than the suite's 300 s per test on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


def test_sglangs_cpu_engine_computes_what_transformers_computes(dense_scenario):
    """SGLang's CPU engine with the harness (its sgl_kernel stand-in writes the request-to-token table) computes the
    model as transformers does: the same greedy tokens, logprobs within bf16 rounding. (The one comparison with a
    tolerance: transformers is another implementation, with other kernels; every hit is judged exactly.)"""
    cold = dense_scenario.tiercache.cold
    reference = transformers_greedy(dense_scenario.model, DENSE_PROMPT, len(cold.tokens))
    assert cold.tokens == [token for token, _ in reference]
    worst = max(abs(logprob - expected) for (logprob, _), (_, expected) in zip(cold.output, reference))
    assert worst < 0.02, f"SGLang's logprobs differ from transformers' by {worst:.4f}"


def test_a_dense_hit_is_recomputation_bit_for_bit(dense_scenario):
    """SGLang's own device hit computes the 8 tokens after the hit as the cold run did, with the same outputs and the
    same bytes (its torch_native extend attention runs over the whole sequence either way), on both writers."""
    for written in (dense_scenario.tiercache, dense_scenario.file):
        assert_exact(written.own, written.cold, "SGLang's own dense hit against its cold run")
    assert_exact(dense_scenario.tiercache.own, dense_scenario.file.own, "the two writers' own hits")


def test_sglangs_own_storage_hit_is_its_device_hit(dense_scenario):
    """SGLang's own L3 hit (a fresh engine reading HiCacheFile) against its device hit: identical, so the device hit
    is the reference a storage hit must meet."""
    file_restored = dense_scenario.file_restored
    assert (file_restored.storage_backend, file_restored.storage) == ("HiCacheFile", DENSE_HIT), file_restored.details
    assert_exact(file_restored, dense_scenario.file.own, "SGLang's file-backend hit against its device hit")


def test_a_fresh_engine_restores_the_prefix_from_tiercache_exactly(dense_scenario):
    restored, file_restored = dense_scenario.restored, dense_scenario.file_restored
    assert (restored.storage_backend, restored.storage) == ("TierCacheStorage", DENSE_HIT), restored.details
    assert restored.details == {**file_restored.details, "storage_backend": "TierCacheStorage"}, \
        f"TierCacheStorage: {restored.details}; SGLang's file backend: {file_restored.details}"
    # Both backends stored the same pages: every full page of the writer's requests (the prompt's 12, and one of
    # prompt and outputs).
    assert dense_scenario.server_objects == dense_scenario.file_objects[0] > len(DENSE_PROMPT) // DENSE_PAGE
    assert_exact(restored, dense_scenario.tiercache.own, "the restore from tiercache against SGLang's own device hit")
