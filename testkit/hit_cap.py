"""vLLM's own prefix hit held to a length the client names, per request: the reference engine of the lab's exact
replay (lab/serving/exact.py) computes each request of a run resuming from exactly where that run's engine
resumed, so the two computations are split at the same positions and must agree by `==`.

A request names its cap as `vllm_xargs: {"tiercache_hit_cap": H}` (vLLM passes it to the engine as the sampling
params' extra_args). vLLM then searches its prefix cache as usual, for a hit of at most H tokens: it finds exactly H
where it holds the blocks and the recurrent state at H, less where it does not (the response's cached tokens say
which). A request without a cap is looked up as in stock vLLM.
"""

from __future__ import annotations

CAP = "tiercache_hit_cap"
CAPPED_LINE = "testkit: vLLM's prefix hits capped per request (testkit.hit_cap)"  # what an engine that applied it logs


def hit_cap(request) -> int | None:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    cap = extra.get(CAP)
    return None if cap is None else int(cap)


def cap_prefix_hits() -> None:
    """Wrap vLLM 0.32's KVCacheManager.get_computed_blocks: its longest-hit search gets min(its own bound, the cap)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self, request):
        cap = hit_cap(request)
        if cap is None:
            return original(self, request)
        coordinator = self.coordinator
        find = coordinator.find_longest_cache_hit

        def capped(block_hashes, max_cache_hit_length):
            return find(block_hashes, min(max_cache_hit_length, cap))

        coordinator.find_longest_cache_hit = capped  # this call's search only (an instance attribute, removed below)
        try:
            return original(self, request)
        finally:
            del coordinator.find_longest_cache_hit

    KVCacheManager.get_computed_blocks = get_computed_blocks
