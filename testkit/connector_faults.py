"""Faults planted in the connector's load path inside a vLLM engine process (testkit/vllm_engine_process.py), one
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

`HashedFaults` plants `swapped_blocks` or `previous_state` in a served engine (testkit/site: TIERCACHE_PLANT_FAULT), in
the requests whose prompt's digest falls in one in K, and writes each load it went into to a file: the lab's exact
replay (lab/serving/exact.py) must report exactly those requests as wrong, and their dependants.
"""

from __future__ import annotations

import dataclasses
import hashlib

KINDS = ("swapped_blocks", "previous_state", "flipped_state_bit", "hit_one_longer")
SERVED_KINDS = ("swapped_blocks", "previous_state")  # those HashedFaults plants in the load plan
PLANTED_LINE = "testkit: faults planted in tiercache's connector (testkit.connector_faults)"  # a served engine's log


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


def prompt_digest(tokens) -> str:
    """A prompt's name in the planted log (the lab computes the same from the prompts it sent)."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


class HashedFaults:
    """`kind` (SERVED_KINDS) in the loads of every request whose prompt digest falls in one in `one_in`, for a served
    engine, where no test names the prompts and the workers run in a process of their own: the fault goes into the
    load plan on the scheduler's side. `swapped_blocks`: the blocks of the load's first and last kv chunk trade places
    (each chunk's pages are written into the other's block); `previous_state`: the deepest state tiercache holds below
    the hit's is loaded instead. A load it cannot go into (one chunk; no earlier state) goes in as it is. Each load a
    fault went into is logged: the prompt's digest, the fault, the first prompt position it made wrong, the name the
    client gave the request (NAMED; two requests may send the same prompt) and vLLM's id for it."""

    def __init__(self, kind: str, one_in: int, log_path: str) -> None:
        if kind not in SERVED_KINDS:
            raise ValueError(f"a served engine takes {SERVED_KINDS}, not {kind!r}")
        self.kind, self.one_in, self.log_path = kind, max(1, one_in), log_path

    def chosen(self, request) -> str | None:
        digest = prompt_digest(request.prompt_token_ids or ())
        return None if int(digest, 16) % self.one_in else digest

    def install(self) -> None:
        from tiercache.connector.vllm.plan import Planner

        faults, allocated = self, Planner.allocated

        def planted_allocated(planner, request, block_ids, num_external_tokens):
            allocated(planner, request, block_ids, num_external_tokens)
            digest = faults.chosen(request) if num_external_tokens > 0 else None
            if digest is not None:
                faults._plant(planner, request, digest)

        Planner.allocated = planted_allocated

    def _plant(self, planner, request, digest: str) -> None:
        job = planner._loads[-1]
        planted = _blocks_swapped(job) if self.kind == "swapped_blocks" else _earlier_state(planner, job)
        if planted is None:
            return
        job, first_wrong = planted
        planner._loads[-1] = job
        with open(self.log_path, "a") as log:
            log.write(f"{digest}\t{self.kind}\t{first_wrong}\t{_named(request)}\t{job.req_id}\n")


NAMED = "tiercache_request"  # the client's name for a request, in its vllm_xargs (the lab sends its trace index)


def _named(request) -> str:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    return str(extra.get(NAMED, "?"))


def _blocks_swapped(job):
    """The load with its first and last kv chunk's blocks traded (every attention group), and the first chunk's start;
    None for a load of fewer than two chunks."""
    from tiercache.prefix.objects import ObjectKind

    kv = [i for i, t in enumerate(job.transfers) if t.ref.kind is ObjectKind.KV]
    groups = {job.transfers[i].ref.group for i in kv}
    transfers = list(job.transfers)
    first_wrong = None
    for group in groups:
        chunks = [i for i in kv if transfers[i].ref.group == group]
        if len(chunks) < 2:
            return None
        first, last = min(chunks, key=lambda i: transfers[i].ref.position), \
            max(chunks, key=lambda i: transfers[i].ref.position)
        a, b = transfers[first], transfers[last]
        transfers[first], transfers[last] = (dataclasses.replace(a, blocks=b.blocks),
                                             dataclasses.replace(b, blocks=a.blocks))
        first_wrong = min(a.ref.start, first_wrong if first_wrong is not None else a.ref.start)
    if first_wrong is None:
        return None
    return dataclasses.replace(job, transfers=tuple(transfers)), first_wrong


def _earlier_state(planner, job):
    """The load with the deepest state tiercache holds below the hit's in place of the hit's, and the hit's position
    (what is computed from there on is wrong); None when tiercache holds none of every group the load has."""
    from tiercache.prefix.objects import ObjectKind, object_ref

    tracked = planner._requests[job.req_id]
    spec, hashes = tracked.cache.spec, tracked.lookup.hashes
    states = [t.ref for t in job.transfers if t.ref.kind is ObjectKind.STATE]
    if not states:
        return None
    unit = spec.match_unit or 1
    candidates = list(range((states[0].position - 1) // unit * unit, 0, -unit))
    keys = [object_ref(spec, hashes, ObjectKind.STATE, p, ref.group).key for p in candidates for ref in states]
    found = tracked.cache.client.exists(tracked.cache.namespace, keys) if keys else []
    for i, position in enumerate(candidates):
        if all(found[i * len(states):(i + 1) * len(states)]):
            return _with_state_from(planner, job, position), states[0].position
    return None
