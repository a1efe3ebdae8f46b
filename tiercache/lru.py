"""The index of the tiers that keep one (host, disk): recency, eviction order, and exact byte accounting.

Two pools share a tier. KV chunks (and anything else) are evicted least recently used first. Recurrent-state
checkpoints are big (18.6 MiB for Qwen3.5-0.8B against 6.4 MiB of KV per 544-token chunk) and unequal in value, so
they have their own byte budget and are evicted by a value score instead (after Marconi, MLSys 2025):

    score = w * efficiency + (1 - w) * recency

where efficiency is prefill tokens saved per byte held (normalised by the best state in the tier) and recency the
state's rank from least (0) to most (1) recently used. The lowest score goes first: old, shallow states before deep,
recently used ones. KV goes before states when the tier as a whole is full, since a state stands in for far more
compute per byte.

Not thread-safe: each tier guards its index with its own metadata lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from tiercache.chunk import CLASS_STATE, ChunkMeta
from tiercache.keys import ChunkKey


class Entry(Protocol):
    record_bytes: int
    meta: ChunkMeta


E = TypeVar("E", bound=Entry)


class ChunkIndex(Generic[E]):
    def __init__(self, state_value_weight: float = 0.5) -> None:
        self._kv: OrderedDict[ChunkKey, E] = OrderedDict()
        self._states: OrderedDict[ChunkKey, E] = OrderedDict()
        self._value_weight = state_value_weight
        self.used_bytes = 0
        self.state_bytes = 0
        self.bytes_by_namespace: dict[str, int] = {}
        self.chunks_by_namespace: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._kv) + len(self._states)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._kv or key in self._states

    @property
    def state_chunks(self) -> int:
        return len(self._states)

    def peek(self, key: ChunkKey) -> E | None:
        """The entry without changing its recency."""
        entry = self._kv.get(key)
        return entry if entry is not None else self._states.get(key)

    def touch(self, key: ChunkKey) -> E | None:
        """The entry, now marked most recently used."""
        for pool in (self._kv, self._states):
            entry = pool.get(key)
            if entry is not None:
                pool.move_to_end(key)
                return entry
        return None

    def add(self, key: ChunkKey, entry: E) -> None:
        """Insert as most recently used. The key must not be present (remove it first)."""
        assert key not in self, key
        self._pool(entry)[key] = entry
        self._account(key.namespace, entry, 1)

    def remove(self, key: ChunkKey) -> E | None:
        for pool in (self._kv, self._states):
            entry = pool.pop(key, None)
            if entry is not None:
                self._account(key.namespace, entry, -1)
                return entry
        return None

    def eviction_order(self, eligible: Callable[[E], bool] = lambda e: True) -> Iterator[tuple[ChunkKey, E]]:
        """Everything, in the order it should go when the tier is full: KV by recency, then states by value."""
        yield from ((k, e) for k, e in list(self._kv.items()) if eligible(e))
        yield from self.states_by_value(eligible)

    def states_by_value(self, eligible: Callable[[E], bool] = lambda e: True) -> Iterator[tuple[ChunkKey, E]]:
        """States from lowest to highest score (see the module docstring)."""
        states = list(self._states.items())
        if not states:
            return
        best = max(e.meta.prefix_tokens / max(e.record_bytes, 1) for _, e in states) or 1.0
        last = max(len(states) - 1, 1)
        w = self._value_weight

        def score(rank_entry: tuple[int, tuple[ChunkKey, E]]) -> float:
            rank, (_, entry) = rank_entry
            efficiency = entry.meta.prefix_tokens / max(entry.record_bytes, 1) / best
            return w * efficiency + (1 - w) * rank / last

        for _, (key, entry) in sorted(enumerate(states), key=score):
            if eligible(entry):
                yield key, entry

    def items(self) -> list[tuple[ChunkKey, E]]:
        return list(self._kv.items()) + list(self._states.items())

    def _pool(self, entry: E) -> OrderedDict[ChunkKey, E]:
        return self._states if entry.meta.object_class == CLASS_STATE else self._kv

    def _account(self, namespace: str, entry: E, count: int) -> None:
        size = entry.record_bytes * count
        self.used_bytes += size
        if entry.meta.object_class == CLASS_STATE:
            self.state_bytes += size
        total = self.bytes_by_namespace.get(namespace, 0) + size
        chunks = self.chunks_by_namespace.get(namespace, 0) + count
        if chunks:
            self.bytes_by_namespace[namespace] = total
            self.chunks_by_namespace[namespace] = chunks
        else:
            self.bytes_by_namespace.pop(namespace, None)
            self.chunks_by_namespace.pop(namespace, None)

    def check(self) -> None:
        """Integrity: totals equal the sums over entries, and every entry sits in the pool of its class."""
        entries = [e for _, e in self.items()]
        assert sum(e.record_bytes for e in entries) == self.used_bytes
        assert sum(e.record_bytes for e in self._states.values()) == self.state_bytes
        assert all(e.meta.object_class == CLASS_STATE for e in self._states.values())
        assert not any(e.meta.object_class == CLASS_STATE for e in self._kv.values())
        assert sum(self.bytes_by_namespace.values()) == self.used_bytes
        assert sum(self.chunks_by_namespace.values()) == len(entries)
