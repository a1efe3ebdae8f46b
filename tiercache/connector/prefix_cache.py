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

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

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
    reached: bool = True  # False when the server could not be asked (then the hit is 0)


@dataclass(frozen=True)
class SaveResult:
    objects: int
    bytes_by_tier: Mapping[str, int]


class PrefixCache:
    def __init__(self, client: Client, spec: CacheSpec, *, report: bool = True,
                 reporter: Callable[[str, int, dict], None] | None = None, all_ranks: bool = False,
                 _rank_lookups: ThreadPoolExecutor | None = None) -> None:
        """`reporter(namespace, requested_tokens, hit_tokens_by_tier)` replaces the blocking ReportLookup call (an
        engine's scheduler hands it to a background thread: statistics must not cost a request a round trip).

        `all_ranks`: the lookup is for every tensor-parallel rank of the layout (an engine's scheduler, whose
        workers each load their own rank's shard): an object counts as present only when every rank's shard is, so
        a shard missing on one rank shortens the hit instead of failing every load of that prefix."""
        self.client = client
        self.spec = spec
        self.namespace = spec.namespace
        self._report = report
        self._reporter = reporter
        self._all_ranks = all_ranks
        layout = spec.layout
        self._other_ranks = [dataclasses.replace(spec, layout=dataclasses.replace(layout, tp_rank=rank)).namespace
                             for rank in range(layout.tp_size) if rank != layout.tp_rank] if all_ranks else []
        self._rank_lookups = _rank_lookups or (ThreadPoolExecutor(len(self._other_ranks),
                                                                  thread_name_prefix="tiercache-rank-lookup")
                                               if self._other_ranks else None)

    def with_spec(self, spec: CacheSpec) -> "PrefixCache":
        """The same client, reporting and rank-lookup threads for another spec (a request's own salt: there may be
        many, and they must not cost a thread pool each)."""
        return PrefixCache(self.client, spec, report=self._report, reporter=self._reporter, all_ranks=self._all_ranks,
                           _rank_lookups=self._rank_lookups)

    def lookup(self, tokens) -> Lookup:
        hashes = self.spec.hashes(tokens)
        probe = plan_probe(self.spec, hashes)
        reached = True
        try:
            where = self._locate(probe.keys) if probe.objects else []
        except Unavailable as exc:
            log.warning("tiercache lookup failed, treating it as a miss: %s", exc)
            where, reached = [None] * len(probe.objects), False
        hit = resolve_hit(self.spec, hashes, probe, where)
        if self._report and reached and hashes.length:
            self._report_lookup(hashes.length, hit.tokens_by_tier())
        present = {ref.key: tier for ref, tier in zip(probe.objects, where) if tier is not None}
        return Lookup(hashes, hit, present, reached)

    def _locate(self, keys: list[bytes]) -> list[str | None]:
        """Where each key's object lies (this rank's tier), or None; with `all_ranks`, None unless every rank holds
        its shard. An engine's ranks name their shards with the same keys (the scheduler's, who plans every save
        and load) in their own namespaces; the other ranks are asked at the same time as this one."""
        others = [self._rank_lookups.submit(self.client.locate, namespace, keys) for namespace in self._other_ranks]
        where = self.client.locate(self.namespace, keys)
        for future in others:
            where = [tier if other is not None else None for tier, other in zip(where, future.result())]
        return where

    def _report_lookup(self, requested_tokens: int, hit_tokens_by_tier: dict) -> None:
        if self._reporter is not None:
            self._reporter(self.namespace, requested_tokens, hit_tokens_by_tier)
            return
        try:
            self.client.report_lookup(self.namespace, requested_tokens, hit_tokens_by_tier)
        except Unavailable:
            pass  # statistics only

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


class BackgroundReporter:
    """Sends lookup reports on one background thread, so an engine's scheduler never waits on statistics. When the
    server is slow, reports beyond `max_pending` are dropped (they are counters, not data)."""

    def __init__(self, client: Client, max_pending: int = 64) -> None:
        self.client = client
        self.max_pending = max_pending
        self.dropped = 0
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tiercache-report")

    def __call__(self, namespace: str, requested_tokens: int, hit_tokens_by_tier: dict) -> None:
        with self._lock:
            if self._pending >= self.max_pending:
                self.dropped += 1
                return
            self._pending += 1
        self._thread.submit(self._send, namespace, requested_tokens, hit_tokens_by_tier)

    def _send(self, namespace: str, requested_tokens: int, hit_tokens_by_tier: dict) -> None:
        try:
            self.client.report_lookup(namespace, requested_tokens, hit_tokens_by_tier)
        except Exception as exc:  # statistics only: never let a report fail anything
            log.debug("tiercache lookup report dropped: %s", exc)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


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
