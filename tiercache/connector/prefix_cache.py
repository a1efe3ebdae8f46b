"""PrefixCache: the I/O around tiercache.hybrid's rules, shared by every engine connector.

lookup = hash the prompt, ONE Exists call for the probe, apply the hit rule;
load   = ONE Get stream for the hit's objects (a missing or corrupt object turns the hit into a miss);
save   = ONE Put stream for what admission planned (states marked so the server keeps them under the state budget).
The engine-specific part (which bytes an object holds) stays in the adapter.

The cache must never fail a request: when the server is unreachable (UNAVAILABLE, deadline) a lookup is a miss, a
load is None and a save is skipped, each with a warning. A put refused for capacity or quota is skipped the same
way. Errors that mean a misconfiguration (bad token, another tenant's namespace, malformed input) are raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from tiercache.chunk import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.client import Chunk, Client
from tiercache.errors import CapacityExceeded, Unavailable
from tiercache.hybrid import (CacheSpec, Hit, ObjectKind, ObjectRef, SavePlan, plan_finish_admission,
                              plan_probe, plan_prompt_admission, resolve_hit)
from tiercache.keys import PrefixHashes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    """A prompt's hashes, its hit, and the presence the probe saw (admission reuses it: no second Exists)."""

    hashes: PrefixHashes
    hit: Hit
    present: Mapping[bytes, str]


@dataclass(frozen=True)
class SaveResult:
    objects: int
    bytes_by_tier: Mapping[str, int]


class PrefixCache:
    def __init__(self, client: Client, spec: CacheSpec, *, report: bool = True) -> None:
        self.client = client
        self.spec = spec
        self.namespace = spec.namespace
        self._report = report

    def lookup(self, tokens) -> Lookup:
        hashes = self.spec.hashes(tokens)
        probe = plan_probe(self.spec, hashes)
        try:
            where = self.client.locate(self.namespace, probe.keys) if probe.objects else []
        except Unavailable as exc:
            log.warning("tiercache lookup failed, treating it as a miss: %s", exc)
            where = [None] * len(probe.objects)
        hit = resolve_hit(self.spec, hashes, probe, where)
        if self._report and hashes.length:
            try:
                self.client.report_lookup(self.namespace, hashes.length, hit.tokens_by_tier())
            except Unavailable:
                pass  # statistics only
        present = {ref.key: tier for ref, tier in zip(probe.objects, where) if tier is not None}
        return Lookup(hashes, hit, present)

    def load(self, hit: Hit) -> dict[ObjectRef, bytes] | None:
        """The bytes of every object of the hit, or None when any is gone or failed its checksum (then recompute)."""
        loaded = self.load_with_tiers(hit)
        return None if loaded is None else loaded[0]

    def load_with_tiers(self, hit: Hit) -> tuple[dict[ObjectRef, bytes], dict[str, int]] | None:
        """Like load, with the bytes read from each tier (for benchmarks and logs)."""
        refs = [o.ref for o in hit.objects]
        try:
            fetched = self.client.fetch_many(self.namespace, [r.key for r in refs]) if refs else []
        except Unavailable as exc:
            log.warning("tiercache load failed, recomputing: %s", exc)
            return None
        if any(f is None for f in fetched):
            return None
        by_tier: dict[str, int] = {}
        for f in fetched:
            by_tier[f.tier] = by_tier.get(f.tier, 0) + len(f.data)
        return {ref: f.data for ref, f in zip(refs, fetched)}, by_tier

    def plan_prompt(self, lookup: Lookup) -> SavePlan:
        return plan_prompt_admission(self.spec, lookup.hashes, lookup.hit.tokens, lookup.present)

    def plan_finish(self, tokens, prompt_tokens: int) -> tuple[PrefixHashes, SavePlan]:
        """What to save at the end of a request whose cache covers `tokens` (prompt and output): one Exists call."""
        hashes = self.spec.hashes(tokens)
        plan = plan_finish_admission(self.spec, hashes, prompt_tokens)
        try:
            where = self.client.locate(self.namespace, [r.key for r in plan.objects]) if plan.objects else []
        except Unavailable:
            where = [None] * len(plan.objects)  # the save that follows will be skipped too
        present = {r.key: t for r, t in zip(plan.objects, where) if t is not None}
        return hashes, plan_finish_admission(self.spec, hashes, prompt_tokens, present)

    def save(self, payloads: Mapping[ObjectRef, object]) -> SaveResult:
        return save_objects(self.client, self.namespace, payloads)


def save_objects(client: Client, namespace: str, payloads: Mapping[ObjectRef, object]) -> SaveResult:
    """Put the objects' bytes in one stream; states carry their prefix length as their value. Skipped, with a
    warning, when the server is unreachable or refuses the bytes for capacity (a cache must not fail a request)."""
    refs: Sequence[ObjectRef] = sorted(payloads)
    chunks = [Chunk(ref.key, payloads[ref], _meta(ref)) for ref in refs]
    try:
        tiers = client.put_many(namespace, chunks)
    except (Unavailable, CapacityExceeded) as exc:
        log.warning("tiercache save of %d objects skipped: %s", len(chunks), exc)
        return SaveResult(0, {})
    by_tier: dict[str, int] = {}
    for ref, tier in zip(refs, tiers):
        by_tier[tier] = by_tier.get(tier, 0) + len(memoryview(payloads[ref]).cast("B"))
    return SaveResult(len(refs), by_tier)


def _meta(ref: ObjectRef) -> ChunkMeta:
    if ref.kind is ObjectKind.STATE:
        return ChunkMeta(CLASS_STATE, ref.position)
    return ChunkMeta(CLASS_KV, ref.tokens)
