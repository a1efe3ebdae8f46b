"""The scheduler half of the vLLM connector: which objects to load into which blocks, and which to save from where.

vLLM calls it from its scheduler process; everything it decides travels to the workers in `StepPlan` (plain
picklable data). The rules:
- a hit is tiercache's hybrid hit (tiercache.prefix): KV chunks, a tail when it ends between blocks, and the
  recurrent state at exactly that position. vLLM copies a request's Mamba state out of block (p-1)//B before the
  connector's per-step hooks run, so every load is asynchronous: the request waits (WAITING_FOR_REMOTE_KVS) until the
  worker reports it, and a failed load is reported as failed (vLLM then recomputes, with
  kv_load_failure_policy=recompute). Blocks vLLM already holds (its own prefix cache) are never written;
- saves follow the computation, and what is saved is decided by tiercache.prefix's admission rules, the same ones
  the transformers connector follows (`plan_step_admission`, `plan_finish_admission`): a `kv` object as soon as its
  block is computed, a `state` (and the `tail` beside it when it is not block-aligned) when vLLM hands over an
  align-mode boundary state the prompt's admission wants, and tail + state where a request ends (the next chat
  turn's prefix) — vLLM keeps those blocks until the worker has copied them.
Keys are tiercache's own chain hashes of the token ids (deterministic across processes and engines; vLLM's block
hashes are seeded per process unless PYTHONHASHSEED is set). A request's LoRA adapter and cache_salt become part of
its namespace; requests with multimodal inputs or prompt embeddings are neither looked up nor saved (token ids alone
do not name their KV).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from tiercache.connector.pod_registration import PodRegistration
from tiercache.connector.prefix_cache import EngineBlock, Lookup, PrefixCache
from tiercache.connector.vllm.layout import EngineGroups
from tiercache.connector.vllm.salts import PerSalt, joined_salt, request_salt
from tiercache.prefix.admission import plan_finish_admission, plan_step_admission
from tiercache.prefix.delivered import Delivered
from tiercache.prefix.hashes import PrefixHashes, token_bytes
from tiercache.prefix.objects import ObjectKind, ObjectRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """One object and where its bytes live in the paged cache."""

    ref: ObjectRef
    blocks: tuple[int, ...]  # kv/tail: the one attention block whose page it is; state: one block per Mamba group
    # The bytes live in a block the request's next step writes (its running recurrent state): a copy that runs
    # beside vLLM (CUDA) must be done before that step. Full blocks, committed boundary states and the blocks of a
    # finished request (vLLM keeps them until the worker reports the save) are not written again.
    running: bool = False
    # The block as vLLM names it (tokens, vLLM's block hash), for the server's KV events (docs/events.md): set on kv
    # chunks and tails of the anchor attention group only; the worker of tensor-parallel rank 0 alone sends it.
    engine: EngineBlock | None = None


@dataclass(frozen=True)
class Job:
    req_id: str
    salt: str  # the request's namespace salt; each tensor-parallel rank adds its own rank to the namespace
    transfers: tuple[Transfer, ...]
    finish: bool = False  # a save at a request's end: vLLM frees the blocks once the worker reports it


@dataclass
class StepPlan:
    """What the workers do this step (vLLM's KVConnectorMetadata)."""

    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    idle: bool = False  # vLLM computes nothing this step (e.g. only loads in flight): the workers may wait for them


@dataclass
class _Tracked:
    request: object  # vllm.v1.request.Request (same process)
    cache: PrefixCache
    lookup: Lookup | None = None
    # The chain hashes of the longest token prefix hashed so far (the lookup's, the prompt's): every step of a long
    # prompt plans saves with them, and hashing the prompt again per step cost vLLM's scheduler thread ~1% of a step.
    hashes: PrefixHashes | None = None
    saved: set = field(default_factory=set)  # keys known to be in tiercache (found or written)
    load_failed: bool = False  # then the request is recomputed, never offered the same hit again
    # The load in flight: the tokens it gives the engine beyond its own hit, by tier (counted as delivered only when
    # the workers report it done, as failed when they report it failed).
    loading: dict[str, int] | None = None


@dataclass
class SchedulerStats:
    """The scheduler's counters, as vLLM logs them (its KV-transfer line). A hit counts when the workers report its
    load done (`loaded_tokens`), not when it is planned (`load_tokens_planned`): a load that fails gives the engine
    nothing (`loads_failed`, `failed_load_tokens`; vLLM recomputes)."""

    lookups: int = 0
    lookups_skipped: int = 0  # misses because the server was unreachable
    lookup_tokens: int = 0
    loads_planned: int = 0
    load_tokens_planned: int = 0  # tokens vLLM was told it could load (its external hit, at scheduling)
    loads_done: int = 0
    loaded_tokens: int = 0  # tokens the engine loaded from tiercache beyond its own prefix cache's hit
    loads_failed: int = 0
    failed_load_tokens: int = 0
    saves_planned: int = 0


class Planner:
    def __init__(self, cache: PrefixCache, groups: EngineGroups, engine_blocks: bool = False,
                 registration: PodRegistration | None = None) -> None:
        """`cache` asks the server with a short deadline and a circuit breaker: vLLM's scheduler thread waits for
        every lookup, so a dead or hung server costs one deadline, then nothing per request until it answers.
        `engine_blocks`: the anchor group's kv saves carry their tokens and vLLM's block hash (KV events).
        `registration`: the engine's pod, registered again (in the background) when a lookup finds it missing."""
        self.cache = cache
        self.groups = groups
        self.engine_blocks = engine_blocks
        self.registration = registration
        self.stats = SchedulerStats()
        self._caches: PerSalt[PrefixCache] = PerSalt(self._cache_for)  # by the request's own salt (salts.py)
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[Job] = []
        self._finishes: list[Job] = []

    # -- loads ---------------------------------------------------------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._track(request)
        if tracked is None or tracked.load_failed:
            return 0, False
        length = len(request.all_token_ids)
        if tracked.lookup is None or tracked.lookup.hashes.length != length:
            asked_at = time.monotonic()
            tracked.lookup = tracked.cache.lookup(_tokens(request, length))
            if tracked.lookup.pod_registered is False and self.registration is not None:
                self.registration.lost(asked_at)  # the server restarted: register again, off this thread
            if not tracked.lookup.reached:  # a miss: asked again at the request's next scheduling
                self.stats.lookups_skipped += 1
                tracked.lookup = None
                return 0, False
            tracked.saved |= set(tracked.lookup.present)
            tracked.hashes = tracked.lookup.hashes
            self.stats.lookups += 1
            self.stats.lookup_tokens += length
        hit = tracked.lookup.hit.tokens
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, True

    def allocated(self, request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        tracked = self._requests[request.request_id]
        hit = tracked.lookup.hit
        first = hit.tokens - num_external_tokens  # vLLM holds [0, first) already
        # Pages of blocks vLLM holds whole are left alone; a block it holds in part is its private copy-on-write copy
        # (vLLM copies a partially hit block before the first forward), which the page from tiercache replaces.
        transfers = [self._transfer(o.ref, block_ids) for o in hit.objects
                     if o.ref.kind is ObjectKind.STATE or o.ref.position > first]
        self._loads.append(Job(request.request_id, tracked.cache.spec.salt, tuple(transfers)))
        tracked.loading = hit.loaded_tokens_by_tier(first)
        self.stats.loads_planned += 1
        self.stats.load_tokens_planned += num_external_tokens

    def loads_reported(self, finished: set[str], failed: set[str]) -> Delivered:
        """The workers' report of loads (`finished` includes the failed ones, as vLLM's finished_recving does): what
        they delivered, counted here and returned for the server. A failed request is recomputed, never offered the
        same hit again."""
        report = Delivered()
        for req_id in finished | failed:
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if req_id in failed:
                tracked.load_failed, tracked.lookup = True, None
            if tracked.loading is not None:
                report += Delivered(failed_loads=1, failed_load_tokens=sum(tracked.loading.values())) \
                    if req_id in failed else Delivered(1, tracked.loading)
                tracked.loading = None
        self.stats.loads_done += report.loads
        self.stats.loaded_tokens += report.loaded_tokens
        self.stats.loads_failed += report.failed_loads
        self.stats.failed_load_tokens += report.failed_load_tokens
        return report

    # -- saves ---------------------------------------------------------------------------------------------------

    def plan_step(self, scheduler_output) -> StepPlan:
        plan = StepPlan(loads=self._loads, saves=self._finishes,
                        idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        self._loads, self._finishes = [], []
        block_state = scheduler_output.kv_connector_block_state
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        offloads = block_state.boundary_state_offloads if block_state is not None else {}
        n = self.groups.block_size
        for req_id in set(scheduler_output.num_scheduled_tokens) | set(offloads):
            tracked = self._requests.get(req_id)
            if tracked is None or req_id in gone or block_state is None:
                continue
            request = tracked.request
            start = request.num_computed_tokens  # the plan is built before vLLM advances it
            end = min(start + scheduler_output.num_scheduled_tokens.get(req_id, 0), len(request.all_token_ids))
            offered = offloads.get(req_id, ())
            if not offered and start // n == end // n:
                continue  # no block completed, no state offered (most steps of most requests): nothing to save
            block_ids = block_state.get_block_ids(req_id)
            if block_ids is None:
                continue
            transfers = self._step_saves(tracked, block_ids, start, end, offered)
            if transfers:
                plan.saves.append(Job(req_id, tracked.cache.spec.salt, tuple(transfers)))
                self.stats.saves_planned += len(transfers)
        for req_id in set(scheduler_output.preempted_req_ids or ()) & set(self._requests):
            self._requests[req_id].lookup = None  # it starts over; its next lookup sees what it saved
        return plan

    def finished(self, request, block_ids: tuple[list[int], ...]) -> bool:
        """Plan the save of a request's end; True when vLLM must keep its blocks until the worker copied them."""
        tracked = self._requests.pop(request.request_id, None)
        # With async scheduling a step may still be in flight: it computes the KV of the request's last known token
        # and the state after it (num_computed_tokens counts it already). This save reaches the workers with a later
        # step's metadata, after that step, so the blocks then hold exactly tokens [0, end). Only when vLLM has
        # counted tokens it does not know yet (a token still being sampled) is the state past anything we can name.
        end = request.num_computed_tokens
        if tracked is None or end <= 0 or end > len(request.all_token_ids):
            return False
        spec = tracked.cache.spec
        hashes = tracked.hashes if tracked.hashes is not None and tracked.hashes.length == end else \
            spec.hashes(_tokens(request, end))  # (plan_finish_admission saves up to the hashes' length)
        plan = plan_finish_admission(spec, hashes, request.num_prompt_tokens, tracked.saved)
        transfers = self._transfers_for(tracked, plan.objects, block_ids, {}, running=False)
        if not transfers:
            return False
        self._finishes.append(Job(request.request_id, spec.salt, tuple(transfers), finish=True))
        self.stats.saves_planned += len(transfers)
        return True

    def take_finishes(self) -> list[Job]:
        """End-of-request saves planned and not yet handed to the workers (they go out with the next step)."""
        finishes, self._finishes = self._finishes, []
        return finishes

    def _step_saves(self, tracked: _Tracked, block_ids, start: int, end: int, offered) -> list[Transfer]:
        """What tiercache.prefix's admission wants saved after a step that computed [start, end) and in which vLLM
        committed the boundary states `offered`, and where each object's bytes are."""
        request = tracked.request
        state_blocks = self._complete_states(offered, len(request.all_token_ids))
        n = self.groups.block_size
        if not state_blocks and start // n == end // n:
            return []  # no block completed, no state offered (most decode steps): nothing to hash or save
        deepest = max([end, *state_blocks])
        if deepest <= 0:
            return []
        spec = tracked.cache.spec
        hit = tracked.lookup.hit.tokens if tracked.lookup is not None else 0
        plan = plan_step_admission(spec, self._hashes(tracked, deepest), request.num_prompt_tokens, hit,
                                   (start, end), sorted(state_blocks), tracked.saved)
        return self._transfers_for(tracked, plan.objects, block_ids, state_blocks)

    @staticmethod
    def _hashes(tracked: _Tracked, length: int) -> PrefixHashes:
        """Hashes covering the request's first `length` tokens (they may cover more: a prefix's hashes never
        change). The prompt is hashed once; decode steps that complete a block hash the tokens known by then."""
        if tracked.hashes is None or tracked.hashes.length < length:
            request = tracked.request
            tracked.hashes = tracked.cache.spec.hashes(_tokens(request, len(request.all_token_ids)))
        return tracked.hashes

    def _complete_states(self, offered, limit: int) -> dict[int, tuple[int, ...]]:
        """Offered boundary states by position: the block of each Mamba group. A state of some groups only cannot be
        restored, nor one past the tokens the request knows."""
        by_position: dict[int, dict[int, int]] = {}
        for group_id, block_id, tokens in offered:
            by_position.setdefault(tokens, {})[group_id] = block_id
        return {position: tuple(blocks[g] for g in self.groups.mamba) for position, blocks in by_position.items()
                if self.groups.mamba and set(blocks) == set(self.groups.mamba) and position <= limit}

    def _transfers_for(self, tracked: _Tracked, refs, block_ids, state_blocks: dict[int, tuple[int, ...]],
                       running: bool = True) -> list[Transfer]:
        """Where the planned objects' bytes are: a state in the block vLLM committed it to (or the request's running
        state block), kv and tails in the request's attention blocks. They count as saved from now on. `running`:
        the request goes on, so a state read from its running block is marked as such."""
        tracked.saved.update(ref.key for ref in refs)
        transfers = []
        anchor = tracked.cache.spec.shape.anchor
        for ref in refs:
            if ref.kind is ObjectKind.STATE and ref.position in state_blocks:
                transfers.append(Transfer(ref, state_blocks[ref.position]))
            else:
                transfer = self._transfer(ref, block_ids)
                if self.engine_blocks and ref.group == anchor and ref.kind is not ObjectKind.STATE:
                    transfer = dataclasses.replace(transfer, engine=_engine_block(tracked.request, ref))
                transfers.append(dataclasses.replace(transfer, running=True)
                                 if running and ref.kind is ObjectKind.STATE else transfer)
        return transfers

    def _transfer(self, ref: ObjectRef, block_ids) -> Transfer:
        if ref.kind is ObjectKind.STATE:
            return Transfer(ref, self.groups.state_block(block_ids, ref.position))
        return Transfer(ref, (self.groups.page_block(block_ids, ref.group, ref.start),))

    # -- requests ------------------------------------------------------------------------------------------------

    def _track(self, request) -> _Tracked | None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        if getattr(request, "mm_features", None):
            return None  # token ids alone do not name multimodal KV
        if getattr(request, "prompt_embeds", None) is not None:
            return None  # vLLM fills the token ids of embedded positions with placeholders: they name nothing
        tracked = self._requests[request.request_id] = _Tracked(request, self._caches[request_salt(request)])
        return tracked

    def _cache_for(self, salt: str) -> PrefixCache:
        """The prefix cache of requests with this salt of their own."""
        if not salt:
            return self.cache
        return self.cache.with_spec(dataclasses.replace(self.cache.spec, salt=joined_salt(self.cache.spec.salt, salt)))


def _tokens(request, length: int) -> list[int]:
    """The request's first `length` token ids as a list (vLLM's ConstantList slices to one); tiercache's hashing
    takes lists without numpy's conversions and range checks."""
    return request.all_token_ids[:length]


def _engine_block(request, ref: ObjectRef) -> EngineBlock:
    """The tokens [start, position) of a kv chunk or tail, and vLLM's hash of the block ending at its position when
    vLLM hashed one there (`request.block_hashes`, one per hash block of `hash_block_size` tokens: a kv chunk's is
    the hash at its last hash block; a tail has none). vLLM publishes the low 64 bits of its hashes
    (kv_cache_utils.maybe_convert_block_hash), and so do we."""
    tokens = token_bytes(list(request.all_token_ids[ref.start:ref.position]))
    hashes = getattr(request, "block_hashes", None) or ()
    size = _hash_block_size(len(request.all_token_ids), len(hashes), ref.tokens) if ref.kind is ObjectKind.KV else 0
    if not size or ref.position % size:
        return EngineBlock(tokens)
    digest = hashes[ref.position // size - 1]
    value = int.from_bytes(digest, "big") & ((1 << 64) - 1) if isinstance(digest, bytes) else int(digest)
    return EngineBlock(tokens, value)


def _hash_block_size(tokens: int, hashes: int, chunk_tokens: int) -> int:
    """vLLM's hash block size, read off a request: it hashes every full block of that many tokens, so it is the
    divisor of N for which the counts agree (0 when none does: no hash is sent)."""
    for size in range(chunk_tokens, 0, -1):
        if chunk_tokens % size == 0 and hashes and tokens // size == hashes:
            return size
    return 0
