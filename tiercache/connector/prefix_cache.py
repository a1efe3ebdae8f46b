"""PrefixCache: the I/O around tiercache.prefix's rules, shared by every engine connector.

lookup = hash the prompt's chunk boundaries, ONE Lookup call with them and the last chunk's tokens: the server
         applies the hit rule over the chain and counts the lookup (a second call when it names checkpoints further
         back whose hash it needs);
load   = ONE Get stream for the hit's objects (a missing or corrupt object turns the hit into a miss);
save   = ONE Put stream for what admission planned (states marked so the server keeps them under the state budget).
The engine-specific part (which bytes an object holds) stays in the adapter.

The cache must never fail a request: when the server is unreachable (UNAVAILABLE, deadline) a lookup is a miss, a
load is None and a save is skipped, each with a warning. A put refused for capacity or quota is skipped the same
way. Errors that mean a misconfiguration (bad token, another tenant's namespace, malformed input) are raised.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from tiercache.client import Chunk, Client, LookupAnswer
from tiercache.errors import CapacityExceeded, CircuitOpen, TierCacheError, Unavailable
from tiercache.prefix.admission import SavePlan, plan_finish_admission, plan_prompt_admission
from tiercache.prefix.delivered import DROPPED_REFUSED, DROPPED_UNREACHABLE, Delivered, summed_counts
from tiercache.prefix.hashes import HASH_BYTES, PrefixHashes
from tiercache.prefix.hit import Hit, Located, required_objects
from tiercache.prefix.objects import CacheSpec, ObjectKind, ObjectRef, object_key, object_meta

log = logging.getLogger(__name__)


class Loaded(NamedTuple):
    """A hit's objects as loaded: their bytes, and the bytes read from each tier."""

    objects: dict[ObjectRef, bytes]
    bytes_by_tier: dict[str, int]


@dataclass(frozen=True)
class Lookup:
    """A prompt's hashes, its hit, and whether the server could be asked (when not, the hit is 0)."""

    hashes: PrefixHashes
    hit: Hit
    reached: bool = True
    attention_groups: tuple[int, ...] = ()
    # The server's word on the cache's pod (PrefixCache's pod_id): False when it does not know it (it restarted and
    # lost the registration); None when it was not asked or does not say.
    pod_registered: bool | None = None

    @functools.cached_property
    def present(self) -> frozenset[bytes]:
        """Keys known to be stored (admission skips them): the hit's objects and the kv chunks the chain holds."""
        known = [o.ref.key for o in self.hit.objects]
        chunks = self.hit.chain_chunks
        if chunks:
            boundaries = self.hashes.boundaries(chunks)
            known += [object_key(boundaries[HASH_BYTES * k:HASH_BYTES * (k + 1)], ObjectKind.KV, group)
                      for group in self.attention_groups for k in range(1, chunks + 1)]
        return frozenset(known)


@dataclass(frozen=True)
class SaveResult:
    objects: int  # stored
    bytes_by_tier: Mapping[str, int]
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)  # objects not stored, by reason (DROP_REASONS)

    def __add__(self, other: "SaveResult") -> "SaveResult":
        return SaveResult(self.objects + other.objects, summed_counts(self.bytes_by_tier, other.bytes_by_tier),
                          summed_counts(self.dropped, other.dropped))


class PrefixCache:
    def __init__(self, client: Client, spec: CacheSpec, *, report: bool = True, all_ranks: bool = False,
                 pod_id: str = "") -> None:
        """`report`: the server counts this cache's lookups in its statistics, and `load` reports what it delivered
        (an engine with a prefix cache of its own, vLLM's, reports from its connector instead: tiercache.connector.
        delivery).

        `pod_id`: the engine's pod for KV events; every lookup names it, and its answer says whether the server still
        has the pod registered (Lookup.pod_registered): how an engine notices a server that restarted.

        `all_ranks`: the lookup is for every tensor-parallel rank of the layout (an engine's scheduler, whose
        workers each load their own rank's shard): an object counts as present only when every rank's shard is, so
        a shard missing on one rank shortens the hit instead of failing every load of that prefix. An engine's
        ranks name their shards with the same keys (the scheduler's, who plans every save and load) in their own
        namespaces."""
        self.client = client
        self.spec = spec
        self.namespace = spec.namespace
        self._report = report
        self._all_ranks = all_ranks
        self.pod_id = pod_id
        layout = spec.layout
        self._other_ranks = [dataclasses.replace(spec, layout=dataclasses.replace(layout, tp_rank=rank)).namespace
                             for rank in range(layout.tp_size) if rank != layout.tp_rank] if all_ranks else []

    def rank_namespaces(self) -> list[str]:
        """Every tensor-parallel rank's namespace, rank 0 first (what a pod registers for KV events)."""
        layout = self.spec.layout
        return [dataclasses.replace(self.spec, layout=dataclasses.replace(layout, tp_rank=rank)).namespace
                for rank in range(layout.tp_size)]

    def with_spec(self, spec: CacheSpec) -> "PrefixCache":
        """The same client and settings for another spec (a request's own salt)."""
        return PrefixCache(self.client, spec, report=self._report, all_ranks=self._all_ranks, pod_id=self.pod_id)

    def lookup(self, tokens) -> Lookup:
        hashes = self.spec.hashes(tokens)
        length = hashes.length
        if length < 2:
            return Lookup(hashes, Hit(0, length))
        positions: dict[int, bytes] = {}
        try:
            answer = self._ask(hashes, positions)
            if answer.unverified:  # checkpoints further back than the hashes sent: one more call, with theirs
                positions.update((p, hashes.at(p)) for p in answer.unverified)
                answer = self._ask(hashes, positions)
        except Unavailable as exc:
            _log_failure("tiercache lookup failed, treating it as a miss: %s", exc)
            return Lookup(hashes, Hit(0, length), reached=False)
        refs = required_objects(self.spec, hashes, answer.hit_tokens) if answer.hit_tokens else []
        located = tuple(Located(ref, tier) for ref, tier in zip(refs, answer.tiers))
        return Lookup(hashes, Hit(answer.hit_tokens, length, located, answer.chain_chunks),
                      attention_groups=self.spec.shape.attention, pod_registered=answer.pod_registered)

    def _ask(self, hashes: PrefixHashes, positions: dict[int, bytes]) -> LookupAnswer:
        last = hashes.length - 1
        deepest = last // self.spec.chunk_tokens
        return self.client.lookup(self.namespace, self.spec.shape, hashes.length, hashes.boundaries(deepest),
                                  positions, rank_namespaces=self._other_ranks, report=self._report,
                                  last_chunk_tokens=hashes.chunk_tokens_bytes(deepest, last),
                                  match_unit=self.spec.match_unit, pod_id=self.pod_id)

    def load(self, hit: Hit) -> dict[ObjectRef, bytes] | None:
        """The bytes of every object of the hit, or None when any is gone or failed its checksum (then recompute)."""
        loaded = self.load_with_tiers(hit)
        return None if loaded is None else loaded.objects

    def load_with_tiers(self, hit: Hit) -> "Loaded | None":
        """Like load, with the bytes read from each tier (for benchmarks and logs). The caller holds none of the
        prompt itself (a transformers model, a simulated engine): with `report`, the whole hit counts as delivered
        when every object came back, as a failed load when not."""
        refs = [o.ref for o in hit.objects]
        try:
            fetched = self.client.get_many(self.namespace, [r.key for r in refs])
        except (Unavailable, CapacityExceeded) as exc:  # CapacityExceeded: the server's stream limit
            _log_failure("tiercache load failed, recomputing: %s", exc)
            self._report_load(hit, ok=False)
            return None
        if any(f is None for f in fetched):
            self._report_load(hit, ok=False)
            return None
        by_tier: dict[str, int] = {}
        for f in fetched:
            by_tier[f.tier] = by_tier.get(f.tier, 0) + len(f.data)
        self._report_load(hit, ok=True)
        return Loaded({ref: f.data for ref, f in zip(refs, fetched)}, by_tier)

    def _report_load(self, hit: Hit, ok: bool) -> None:
        if not self._report or not hit.tokens:
            return
        delivered = Delivered(1, hit.loaded_tokens_by_tier(0)) if ok else Delivered(failed_loads=1,
                                                                                 failed_load_tokens=hit.tokens)
        try:
            self.client.report_delivery(self.namespace, delivered)
        except TierCacheError as exc:  # statistics only: the load itself stands
            _log_failure("tiercache delivery report not sent: %s", exc)

    def plan_prompt(self, lookup: Lookup) -> SavePlan:
        """What to save after computing the prompt past its hit (nothing the lookup found present)."""
        return plan_prompt_admission(self.spec, lookup.hashes, lookup.hit.tokens, lookup.present)

    def plan_finish(self, tokens, prompt_tokens: int) -> SavePlan:
        """What to save at the end of a request whose cache covers `tokens` (prompt and output), of which the first
        `prompt_tokens` were the prompt: nothing already present (one Exists call)."""
        hashes = self.spec.hashes(tokens)
        plan = plan_finish_admission(self.spec, hashes, prompt_tokens)
        try:
            where = self.client.locate(self.namespace, [r.key for r in plan.objects]) if plan.objects else []
        except Unavailable:
            where = [None] * len(plan.objects)  # the save that follows will be skipped too
        present = {r.key: t for r, t in zip(plan.objects, where) if t is not None}
        return plan_finish_admission(self.spec, hashes, prompt_tokens, present)

    def save(self, payloads: Mapping[ObjectRef, object]) -> SaveResult:
        return save_objects(self.client, self.namespace, payloads)


class EngineBlock(NamedTuple):
    """What the engine calls a block: its token ids as little-endian uint32 and the engine's own 64-bit block hash
    (0: unknown). Sent with the kv chunks of one attention group in one rank; the server publishes KV events for
    routers from them (docs/events.md)."""

    tokens: bytes
    engine_hash: int = 0


class WithEngineBlock(NamedTuple):
    """A payload for `save_objects` whose object carries its EngineBlock."""

    data: object
    engine: EngineBlock


def save_objects(client: Client, namespace: str, payloads: Mapping[ObjectRef, object]) -> SaveResult:
    """Put the objects' bytes in one stream; states carry their prefix length as their value. A payload may be a
    WithEngineBlock (its meta then carries the engine's tokens and hash). Skipped, with a warning, when the server is
    unreachable or refuses the bytes for capacity (a cache must not fail a request)."""
    refs: Sequence[ObjectRef] = sorted(payloads)
    chunks = [_chunk(ref, payloads[ref]) for ref in refs]
    try:
        tiers = client.put_many(namespace, chunks)
    except (Unavailable, CapacityExceeded) as exc:
        _log_failure(f"tiercache save of {len(chunks)} objects skipped: %s", exc)
        reason = DROPPED_REFUSED if isinstance(exc, CapacityExceeded) else DROPPED_UNREACHABLE
        return SaveResult(0, {}, {reason: len(chunks)})
    by_tier: dict[str, int] = {}
    for chunk, tier in zip(chunks, tiers):
        by_tier[tier] = by_tier.get(tier, 0) + len(memoryview(chunk.data).cast("B"))
    return SaveResult(len(refs), by_tier)


def _chunk(ref: ObjectRef, payload) -> Chunk:
    if isinstance(payload, WithEngineBlock):
        meta = object_meta(ref)._replace(tokens=payload.engine.tokens, engine_hash=payload.engine.engine_hash)
        return Chunk(ref.key, payload.data, meta)
    return Chunk(ref.key, payload, object_meta(ref))


def _log_failure(message: str, error: Exception) -> None:
    """A warning per failed call, except while the client's breaker is open (it logged the outage once)."""
    (log.debug if isinstance(error, CircuitOpen) else log.warning)(message, error)
