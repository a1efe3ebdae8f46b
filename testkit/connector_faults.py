"""Faults planted in the connector's load path inside a vLLM engine process (tests/vllm_engine/engine_process.py), one
request at a time, so that tests/vllm_engine/test_planted_faults.py can show that each exactness gate of the harness
fails on the faults it is meant to catch. tiercache itself has no switch for this: the engine process wraps three
methods of the connector (the scheduler's Planner and the worker's Loads, both in this process with the uni
executor), and a wrapper acts only on a request whose prompt the test named in its generate command.

The faults, and where each one is planted:
- `swapped_blocks`: after a load is copied into vLLM's blocks (Loads._into_blocks), the pages of two of its kv
  chunks trade places (the first and the last chunk of the hit, in every attention layer);
- `previous_state`: the plan loads the state saved at an earlier position (`position`, which the test made sure the
  server holds) into the block of the hit's state (Planner.allocated);
- `flipped_state_bit`: after the load is copied (its checksum verified by then), one bit of the state changes: the
  lowest bit of the middle byte of the first Mamba layer's state bytes;
- `hit_one_longer`: the hit is reported to vLLM's scheduler one token longer than what is loaded
  (Planner.matched_tokens, vLLM's get_num_new_matched_tokens).
"""

from __future__ import annotations

import dataclasses

KINDS = ("swapped_blocks", "previous_state", "flipped_state_bit", "hit_one_longer")


class PlantedFaults:
    def __init__(self) -> None:
        self._by_prompt: dict[tuple[int, ...], dict] = {}
        self._by_request: dict[str, dict] = {}

    def plant(self, prompts: list[list[int]], faults: list[dict | None]) -> None:
        """The fault of each prompt of the next generate (None: none)."""
        unknown = [f["kind"] for f in faults if f is not None and f["kind"] not in KINDS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {KINDS}")
        self._by_prompt = {tuple(p): f for p, f in zip(prompts, faults) if f is not None}
        self._by_request = {}

    def _of_request(self, request) -> dict | None:
        """The scheduler sees the request first: its id is bound to the prompt's fault there, for the worker."""
        if not self._by_prompt:  # (no fault planted: nothing to look up, on the scheduler's thread)
            return None
        fault = self._by_prompt.get(tuple(request.prompt_token_ids or ()))
        if fault is not None:
            self._by_request[request.request_id] = fault
        return fault

    def install(self) -> None:
        from tiercache.connector.vllm.loads import Loads
        from tiercache.connector.vllm.plan import Planner

        faults = self
        matched_tokens, allocated, into_blocks = Planner.matched_tokens, Planner.allocated, Loads._into_blocks

        def planted_matched_tokens(planner, request, num_computed_tokens):
            tokens, asynchronous = matched_tokens(planner, request, num_computed_tokens)
            fault = faults._of_request(request)
            if fault is not None and fault["kind"] == "hit_one_longer" and tokens:
                return tokens + 1, asynchronous
            return tokens, asynchronous

        def planted_allocated(planner, request, block_ids, num_external_tokens):
            allocated(planner, request, block_ids, num_external_tokens)
            fault = faults._of_request(request)
            if fault is not None and fault["kind"] == "previous_state" and num_external_tokens > 0:
                planner._loads[-1] = _with_state_from(planner, planner._loads[-1], fault["position"])

        def planted_into_blocks(loads, job, rows, ready):
            done = into_blocks(loads, job, rows, ready)
            fault = faults._by_request.get(job.req_id) if faults._by_request else None
            if fault is not None and fault["kind"] == "swapped_blocks":
                _swap_first_and_last_chunk(loads.pools.views, job)
            elif fault is not None and fault["kind"] == "flipped_state_bit":
                _flip_state_bit(loads.pools.views, job)
            return done

        Planner.matched_tokens = planted_matched_tokens
        Planner.allocated = planted_allocated
        Loads._into_blocks = planted_into_blocks


def _with_state_from(planner, job, position: int):
    """The load `job` with its state object replaced by the one saved at `position` (same blocks)."""
    from tiercache.prefix.objects import ObjectKind, object_ref

    tracked = planner._requests[job.req_id]
    transfers = []
    for transfer in job.transfers:
        if transfer.ref.kind is ObjectKind.STATE:
            ref = object_ref(tracked.cache.spec, tracked.lookup.hashes, ObjectKind.STATE, position, transfer.ref.group)
            transfer = dataclasses.replace(transfer, ref=ref)
        transfers.append(transfer)
    return dataclasses.replace(job, transfers=tuple(transfers))


def _swap_first_and_last_chunk(views, job) -> None:
    from tiercache.prefix.objects import ObjectKind

    chunks = [t for t in job.transfers if t.ref.kind is ObjectKind.KV and t.ref.group == 0]
    if len(chunks) < 2:
        raise RuntimeError(f"swapped_blocks needs a hit of two kv chunks or more, the load has {len(chunks)}")
    first, last = chunks[0].blocks[0], chunks[-1].blocks[0]
    for pages in views.attention[0]:  # [blocks, page bytes] per layer
        saved = pages[first].clone()
        pages[first] = pages[last]
        pages[last] = saved


def _flip_state_bit(views, job) -> None:
    from tiercache.prefix.objects import ObjectKind

    state = next(t for t in job.transfers if t.ref.kind is ObjectKind.STATE)
    states = views.states[0][0]  # the first Mamba group's first layer: [blocks, state bytes]
    states[state.blocks[0], states.shape[1] // 2] ^= 1
