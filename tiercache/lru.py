"""Recency order and byte accounting for the tiers that keep an index (host, disk).

Not thread-safe: each tier guards its index with its own metadata lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

from tiercache.keys import ChunkKey

E = TypeVar("E")


class LruIndex(Generic[E]):
    """Maps keys to entries, least recently used first, and keeps exact byte totals (overall and per namespace)."""

    def __init__(self, size_of: Callable[[E], int]) -> None:
        self._entries: OrderedDict[ChunkKey, E] = OrderedDict()
        self._size_of = size_of
        self.used_bytes = 0
        self.bytes_by_namespace: dict[str, int] = {}
        self.chunks_by_namespace: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._entries

    def peek(self, key: ChunkKey) -> E | None:
        """The entry without changing its recency."""
        return self._entries.get(key)

    def touch(self, key: ChunkKey) -> E | None:
        """The entry, now marked most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def add(self, key: ChunkKey, entry: E) -> None:
        """Insert as most recently used. The key must not be present (remove it first)."""
        assert key not in self._entries, key
        self._entries[key] = entry
        self._account(key.namespace, self._size_of(entry), 1)

    def remove(self, key: ChunkKey) -> E | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._account(key.namespace, -self._size_of(entry), -1)
        return entry

    def oldest(self, eligible: Callable[[E], bool] = lambda e: True) -> Iterator[tuple[ChunkKey, E]]:
        """Entries from least to most recently used that pass `eligible` (e.g. not pinned by a reader)."""
        for key, entry in list(self._entries.items()):
            if eligible(entry):
                yield key, entry

    def items(self) -> list[tuple[ChunkKey, E]]:
        return list(self._entries.items())

    def _account(self, namespace: str, size: int, count: int) -> None:
        self.used_bytes += size
        total = self.bytes_by_namespace.get(namespace, 0) + size
        chunks = self.chunks_by_namespace.get(namespace, 0) + count
        if chunks:
            self.bytes_by_namespace[namespace] = total
            self.chunks_by_namespace[namespace] = chunks
        else:
            self.bytes_by_namespace.pop(namespace, None)
            self.chunks_by_namespace.pop(namespace, None)

    def check(self) -> None:
        """Integrity: totals equal the sum over entries."""
        total = sum(self._size_of(e) for e in self._entries.values())
        assert total == self.used_bytes, (total, self.used_bytes)
        assert sum(self.bytes_by_namespace.values()) == total
        assert sum(self.chunks_by_namespace.values()) == len(self._entries)
