"""The engine's own bytes at a request's hit, read inside a vLLM engine process (testkit/vllm_engine_process.py).

Just before a request's first forward pass, the bytes vLLM is about to compute from are digested through the
request's own block table, group by group: every full block of the prefix it did not compute (from vLLM's prefix
cache or loaded by the connector), and, in each Mamba group, the block that holds the recurrent state at the hit.
The test compares them with what the yardstick engine holds at its own hit (tests/vllm_engine/gates.py,
assert_same_bytes): a block in the wrong slot, a state from another position or one flipped bit fails there even
where the logprobs happen to agree (tests/vllm_engine/test_planted_faults.py).

Why before the first forward and not after the request: in vLLM 0.32's align mode the state after p tokens lives in
the Mamba block (p-1)//B of the request's block table, and preprocess_mamba copies it into the block of the step's
last token before the forward pass; when both are the same block (a hit and a prompt end inside one block) the
forward pass overwrites the hit state in place, so it is gone by the time the request ends. The full attention
blocks would survive the request (freed, still cached), the state does not. At this point vLLM's own copy-on-write
of a partially hit block has run (GPUModelRunner._update_states) and every load the connector reported is in its
blocks (a request is scheduled only once its load is reported done).

Digests cover whole blocks of each layer's cache tensor (an attention page: every token of the block, K and V; a
Mamba block: each state tensor, conv then SSM, padding excluded), sha256 per block per group.
"""

from __future__ import annotations

import hashlib

import torch


class EngineBytes:
    """Captures each request's digests at its first forward pass while on; `take` hands them out by prompt."""

    def __init__(self) -> None:
        self._captured: dict[tuple[int, ...], dict] = {}
        self._on = False  # off, a forward pass costs one call more: timed runs (benchmarks/vllm_engine.py) keep it off

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        forward = GPUModelRunner._model_forward
        recorder = self

        def _model_forward(runner, *args, **kwargs):
            if recorder._on:
                recorder.capture(runner)
            return forward(runner, *args, **kwargs)

        GPUModelRunner._model_forward = _model_forward

    def start(self, on: bool) -> None:
        """Forget what was captured; capture from now on (`on`) or not."""
        self._captured.clear()
        self._on = on

    def take(self, prompt: list[int]) -> dict | None:
        """The digests of the request with this prompt in the last generate (None: it never ran a forward pass)."""
        return self._captured.get(tuple(prompt))

    def capture(self, runner) -> None:
        for req_id in runner.input_batch.req_ids:
            state = runner.requests[req_id]
            if state.prompt_token_ids is None:
                continue  # a prompt of embeddings: nothing names it
            key = tuple(state.prompt_token_ids)
            if key not in self._captured:  # its first forward pass (a preempted request resumed later is not)
                self._captured[key] = digests(runner, state.block_ids, state.num_computed_tokens)


def digests(runner, block_ids: tuple[list[int], ...], hit: int) -> dict:
    """{"hit": tokens not computed, "groups": per KV cache group {"kind", "blocks": [sha256 per block]}}."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = runner.kv_cache_config
    layers = runner.compilation_config.static_forward_context
    groups = []
    for group_id, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        mamba = isinstance(spec, MambaSpec)
        if mamba:  # the state after `hit` tokens (align mode): block (hit-1)//B
            indices = [(hit - 1) // spec.block_size] if hit else []
        else:  # every full block of the prefix
            indices = list(range(hit // spec.block_size))
        tensors = [_block_tensors(layers[name].kv_cache, mamba, config.num_blocks) for name in group.layer_names]
        blocks = [_digest(tensors, block_ids[group_id][index]) for index in indices]
        groups.append({"kind": "mamba" if mamba else "attention", "blocks": blocks})
    return {"hit": hit, "groups": groups}


def _block_tensors(cache, mamba: bool, num_blocks: int) -> list:
    """A layer's cache tensors, each indexed by block id first: an attention layer's one tensor, a Mamba layer's
    state tensors (conv, SSM)."""
    tensors = list(cache) if mamba else [cache]
    for tensor in tensors:
        if tensor.shape[0] != num_blocks:
            raise RuntimeError(f"a cache tensor {tuple(tensor.shape)} is not indexed by block first "
                               f"({num_blocks} blocks): the digests would read the wrong bytes")
    return tensors


def _digest(tensors_by_layer: list[list], block: int) -> str:
    digest = hashlib.sha256()
    for tensors in tensors_by_layer:
        for tensor in tensors:
            digest.update(tensor[block].contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
