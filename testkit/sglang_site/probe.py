"""The engine's own bytes: what a request's KV pages and Mamba state hold inside SGLang's scheduler, for the
real-engine tests' byte gate (tests/sglang_engine/gates.py). Loaded in every engine process by sitecustomize; it
records only requests whose rid starts with PROBED (testkit/sglang_engine_process.py gives them such a rid when a test
asks): other requests (the benchmarks') pay a string comparison per request and batch.

Per probed request, two moments:
- when its first forward is about to run (`Scheduler.run_batch`): the Mamba state it starts from, the one the hit
  restored (from the device's tree, or loaded from the host pool or storage);
- when SGLang gives its KV row back (`release_kv_cache`, at its end, before the tree takes the row over): each page
  of its KV, read through SGLang's own request-to-token table from the device pool (the restored prefix, the tail it
  computed, its outputs), and its Mamba slot (the state after its last token).
Each is a sha256 per page (or state) per layer group, so a test names the first page and layer that differ.
"""

from __future__ import annotations

import hashlib
import json

from sglang_cpu import patches

PROBED = "probe-"
_records: dict[str, dict] = {}
_start_states: dict[str, dict[str, str] | None] = {}  # rid -> the state its first forward started from


def _digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _kv_pages(kv_pool, slots, page_size: int) -> dict[str, list[str]]:
    """{"k<i>" / "v<i>": the sha256 of each page's rows} of the device KV pool's attention layers (a hybrid's pool
    holds its full-attention layers in `full_kv_pool`)."""
    pool = getattr(kv_pool, "full_kv_pool", None) or kv_pool
    pages = [slots[start:start + page_size] for start in range(0, len(slots), page_size)]
    groups = {}
    for name, buffers in (("k", pool.k_buffer), ("v", pool.v_buffer)):
        for layer, buffer in enumerate(buffers):
            groups[f"{name}{layer}"] = [_digest(buffer[page]) for page in pages]
    return groups


def _state(req_to_token_pool, slot: int) -> dict[str, str]:
    """{"conv<i>.<layer>" / "temporal.<layer>": sha256} of one Mamba slot (conv windows and recurrent state)."""
    cache = req_to_token_pool.mamba_pool.mamba_cache
    state = {}
    for index, conv in enumerate(cache.conv):
        for layer in range(conv.shape[0]):
            state[f"conv{index}.{layer}"] = _digest(conv[layer, slot])
    for layer in range(cache.temporal.shape[0]):
        state[f"temporal.{layer}"] = _digest(cache.temporal[layer, slot])
    return state


def _physical_slot(req_to_token_pool, mamba_index) -> int:
    return int(req_to_token_pool.translate_mamba_indices(mamba_index.reshape(1))[0])


def record(req, tree_cache) -> None:
    """The request's KV pages and Mamba slot, as SGLang's device pools hold them now (its end)."""
    import torch

    pool = tree_cache.req_to_token_pool
    length = req.kv.kv_committed_len
    slots = pool.req_to_token[req.kv.req_pool_idx, :length].to(torch.int64)
    page_size = tree_cache.token_to_kv_pool_allocator.page_size
    entry = {"page_size": page_size, "tokens": length,
             "kv": _kv_pages(tree_cache.token_to_kv_pool_allocator.get_kvcache(), slots, page_size),
             "state_start": None, "state_end": None}
    if getattr(req.kv, "mamba_pool_idx", None) is not None:
        entry["state_start"] = _start_states.pop(req.rid, None)
        entry["state_end"] = _state(pool, _physical_slot(pool, req.kv.mamba_pool_idx))
    _records[req.rid] = entry


@patches("sglang.srt.mem_cache.common")
def _record_at_release(module) -> None:
    release = module.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint: bool):
        if str(req.rid).startswith(PROBED) and req.kv.holds_kv:
            record(req, tree_cache)
        return release(req, tree_cache, checkpoint=checkpoint)
    module.release_kv_cache = release_kv_cache


def _start_state(batch, req, pool) -> dict[str, str] | None:
    """The state `req` starts from in `batch`, its first forward: a device hit's is copied from the tree's slot at the
    forward's start (copy-on-write: batch.mamba_cow_*), a host or storage hit's was loaded into the request's own slot
    when the batch was built (HiCache's host-to-device load runs synchronously on the CPU); a cold request's slot is
    cleared (None)."""
    slot = _physical_slot(pool, req.kv.mamba_pool_idx)
    if batch.mamba_cow_dst_indices is not None:
        sources = dict(zip(pool.translate_mamba_indices(batch.mamba_cow_dst_indices).tolist(),
                           pool.translate_mamba_indices(batch.mamba_cow_src_indices).tolist()))
        if slot in sources:
            return _state(pool, sources[slot])
    if batch.mamba_clear_indices is not None and slot in pool.translate_mamba_indices(
            batch.mamba_clear_indices).tolist():
        return None
    return _state(pool, slot)


def _record_start_states(scheduler, batch) -> None:
    if not batch.forward_mode.is_extend():
        return
    pool = scheduler.req_to_token_pool
    for req in batch.reqs:
        if (str(req.rid).startswith(PROBED) and req.rid not in _start_states
                and getattr(req.kv, "mamba_pool_idx", None) is not None):
            _start_states[req.rid] = _start_state(batch, req, pool)


@patches("sglang.srt.managers.scheduler")
def _probe_rpc(module) -> None:
    run_batch = module.Scheduler.run_batch

    def run_batch_recording(self, batch, *args, **kwargs):
        _record_start_states(self, batch)
        return run_batch(self, batch, *args, **kwargs)
    module.Scheduler.run_batch = run_batch_recording
    module.Scheduler.harness_probe = harness_probe


def harness_probe(self, rid: str, path: str) -> None:
    """Scheduler RPC (Engine.collective_rpc): write the probed request's record to `path` as JSON."""
    if rid not in _records:
        raise KeyError(f"no record for request {rid} (not probed, or not finished)")
    with open(path, "w") as out:
        json.dump(_records.pop(rid), out)
