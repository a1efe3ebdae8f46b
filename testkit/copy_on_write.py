"""vLLM 0.32's copy of a partially hit block in a hybrid model, fixed in the engine's process: tests need vLLM's own
hit as a yardstick, and served benchmark engines need it to be right (docs/vllm.md measured what it costs)."""

from __future__ import annotations

FIXED_LINE = "testkit: vLLM's copy_kv_cache_blocks_inplace fixed (testkit.copy_on_write)"  # what a fixed process logs


def fix_hybrid_copy_on_write() -> None:
    """vLLM 0.32's copy_kv_cache_blocks_inplace copies each backing view once, keyed by its data pointer. In a hybrid
    model a Mamba layer's view and an attention layer's view start at the same address but a Mamba page is shorter,
    so vLLM copies only the Mamba-sized start of each attention page when it copies a partially hit block: the rest
    of the page (here the second KV head) stays zero, and vLLM's own partial prefix hits compute on wrong KV
    (measured: logprobs up to 0.28 off a cold run, docs/vllm.md). The reference engines in these tests
    get the copy done per distinct view, so vLLM's own hit is the right yardstick. tiercache's loads write whole
    pages and need no fix; the engine under test gets it too, so both sides compute alike."""
    import numpy as np
    import torch
    import vllm.v1.worker.gpu_model_runner as runner
    import vllm.v1.worker.utils as utils

    def copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies) -> None:
        if not copies:
            return
        pairs = torch.as_tensor(np.asarray(copies, dtype=np.int64))
        seen = set()
        for cache in kv_caches:
            view = (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype)
            if view in seen:
                continue
            seen.add(view)
            blocks = cache.unflatten(0, (num_blocks, -1))
            blocks[pairs[:, 1]] = blocks[pairs[:, 0]]

    utils.copy_kv_cache_blocks_inplace = copy_kv_cache_blocks_inplace
    runner.copy_kv_cache_blocks_inplace = copy_kv_cache_blocks_inplace
