"""What the store counts and reports: per-tier counters and usage, lookups, deliveries, per-namespace usage."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from tiercache.prefix.delivered import Delivered
from tiercache.tiers.base import TierUsage


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0  # chunks promoted *out of* this tier
    demotions: int = 0  # chunks demoted *into* this tier
    checksum_failures: int = 0
    errors: int = 0  # calls that failed because the tier was down or refused


class TierCounts:
    """The store's counters, per tier, under a lock of their own (the store holds none around tier calls)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._by_tier = {name: TierCounters() for name in names}

    def add(self, tier: str, **increments: int) -> None:
        with self._lock:
            counters = self._by_tier[tier]
            for name, n in increments.items():
                setattr(counters, name, getattr(counters, name) + n)

    def stats(self, usages: Sequence[tuple[str, TierUsage]]) -> tuple["TierStats", ...]:
        """Each tier's counters with its usage, in the order of `usages` ((tier name, usage) pairs)."""
        with self._lock:
            return tuple(TierStats(name, u.up, u.chunks, u.used_bytes, u.capacity_bytes, **vars(self._by_tier[name]),
                                   state_chunks=u.state_chunks, state_bytes=u.state_bytes,
                                   state_budget_bytes=u.state_budget_bytes)
                         for name, u in usages)


@dataclass(frozen=True)
class TierStats:
    name: str
    up: bool
    chunks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    demotions: int
    checksum_failures: int
    errors: int
    state_chunks: int
    state_bytes: int
    state_budget_bytes: int


@dataclass(frozen=True)
class LookupStats:
    """Prefix lookups connectors made: tokens asked for, and tokens found per tier the objects were in. What a lookup
    finds includes the prefix the engine holds itself, so it is no measure of what tiercache gave the engine: that is
    Delivered."""

    lookups: int = 0
    requested_tokens: int = 0
    found_tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NamespaceUsage:
    namespace: str
    used_bytes: int
    chunks: int


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    namespaces: tuple[NamespaceUsage, ...]
    lookups: LookupStats = LookupStats()
    delivered: Delivered = Delivered()


def namespace_usage(usages: Sequence[TierUsage]) -> tuple[NamespaceUsage, ...]:
    """Bytes and chunks per namespace, summed over the tiers' usages, by namespace."""
    used: dict[str, int] = {}
    chunks: dict[str, int] = {}
    for usage in usages:
        for namespace, n in usage.bytes_by_namespace.items():
            used[namespace] = used.get(namespace, 0) + n
        for namespace, n in usage.chunks_by_namespace.items():
            chunks[namespace] = chunks.get(namespace, 0) + n
    return tuple(NamespaceUsage(namespace, n, chunks[namespace]) for namespace, n in sorted(used.items()))
