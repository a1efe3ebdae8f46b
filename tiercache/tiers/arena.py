"""A tier over one preallocated memory arena of fixed-size pages: the host tier (RAM) and the GPU tier (device).

The arena is allocated once at start, never per chunk: fresh memory costs a page fault per 4 KiB on first touch
(1-2 GB/s on our machines against ~12 GB/s into reused memory), and a dict of `bytes` would fragment the heap.
Records are placed by tiercache.allocator (one page of waste per record at most). The memory itself is a small
object with read / write / close (`ArenaMemory`); everything else — index, eviction, pins, budgets — is here, once.

Copies in and out of the arena happen outside the metadata lock. A reader pins its entry, so the pages it is copying
cannot be reused by a concurrent put until it unpins; a record replaced or deleted while pinned frees its pages when
the last reader leaves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

from tiercache import chunk
from tiercache.allocator import Extent, ExtentAllocator
from tiercache.config import state_budget
from tiercache.errors import TierFull
from tiercache.keys import ChunkKey
from tiercache.lru import ChunkIndex
from tiercache.tiers.base import Evicted, TierUsage, index_usage


@dataclass(slots=True)
class _Entry:
    record_bytes: int
    meta: chunk.ChunkMeta
    extents: tuple[Extent, ...]
    pins: int = 0
    dead: bool = False  # removed from the index while pinned: free the pages at the last unpin


class ArenaMemory(Protocol):
    """Where an arena's bytes live. Offsets and sizes are in bytes; ranges never overlap a concurrent write."""

    def write(self, ranges: Sequence[tuple[int, int]], record: memoryview) -> None: ...

    def read(self, ranges: Sequence[tuple[int, int]], size: int) -> bytearray: ...

    def close(self) -> None: ...


class ArenaTier:
    checksum_on_read = False  # the bytes never leave this process's memory
    shared = False

    def __init__(self, name: str, memory: ArenaMemory, capacity_bytes: int, page_bytes: int,
                 state_budget_bytes: int | None, state_value_weight: float) -> None:
        self.name = name
        self.page_bytes = page_bytes
        pages = capacity_bytes // page_bytes
        self.capacity_bytes = pages * page_bytes
        self.state_budget_bytes = min(state_budget(capacity_bytes, state_budget_bytes), self.capacity_bytes)
        self._memory = memory
        self._allocator = ExtentAllocator(pages)
        self._index: ChunkIndex[_Entry] = ChunkIndex(state_value_weight)
        self._state_reserved = 0  # state bytes of puts between allocation and commit
        self._lock = threading.Lock()

    # -- contract ---------------------------------------------------------------------------------------------------

    def put(self, key: ChunkKey, record, *, return_evicted: bool) -> list[Evicted]:
        record = memoryview(record).cast("B")
        meta = chunk.read_meta(record)
        size = len(record)
        state = size if meta.object_class == chunk.CLASS_STATE else 0
        pages = -(-size // self.page_bytes)
        if pages > self._allocator.total_pages or state > self.state_budget_bytes:
            raise TierFull(f"{size} bytes exceed what the host tier may hold")
        evicted: list[Evicted] = []
        with self._lock:
            self._unlink(key)
        while True:
            with self._lock:
                victims = self._choose_victims(pages, state)
                fits = not victims and self._state_excess(state) <= 0
                extents = self._allocator.allocate(pages) if fits else None
                if extents is not None:
                    self._state_reserved += state
                    break
            if not victims:  # everything left is being read right now
                raise TierFull(f"host tier has no room for {size} bytes right now", evicted)
            for victim_key, victim in victims:  # copy victims out without the lock; they are pinned
                evicted.append(Evicted(victim_key, self._read(victim) if return_evicted else None))
            with self._lock:
                for _, victim in victims:
                    self._unpin(victim)  # frees their pages; the next round allocates (or evicts more if raced)
        self._write(extents, record)
        with self._lock:
            self._state_reserved -= state
            self._unlink(key)  # a concurrent put of the same key may have committed meanwhile: last one wins
            self._index.add(key, _Entry(size, meta, extents))
        return evicted

    def get(self, key: ChunkKey) -> bytearray | None:
        with self._lock:
            entry = self._index.touch(key)
            if entry is None:
                return None
            entry.pins += 1
        try:
            return self._read(entry)
        finally:
            with self._lock:
                self._unpin(entry)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return sum(self._unlink(k) for k in keys)

    def usage(self) -> TierUsage:
        with self._lock:
            return index_usage(self._index, self.capacity_bytes, self.state_budget_bytes)

    def close(self) -> None:
        with self._lock:
            self._memory.close()

    # -- inside the lock --------------------------------------------------------------------------------------------

    def _unlink(self, key: ChunkKey) -> bool:
        entry = self._index.remove(key)
        if entry is None:
            return False
        if entry.pins:
            entry.dead = True
        else:
            self._allocator.free(entry.extents)
        return True

    def _choose_victims(self, pages: int, state_bytes: int) -> list[tuple[ChunkKey, _Entry]]:
        """Unlink entries until a record of `pages` (and `state_bytes` of state budget) would fit; pin them for the
        copy-out. States over budget go first, lowest value first; then whatever the index ranks first."""
        victims: list[tuple[ChunkKey, _Entry]] = []
        unpinned = lambda e: e.pins == 0  # noqa: E731
        if state_bytes:
            excess = self._state_excess(state_bytes)
            for key, entry in self._index.states_by_value(unpinned):
                if excess <= 0:
                    break
                victims.append((key, entry))
                excess -= entry.record_bytes
        free = self._allocator.free_pages + sum(e.pages for _, v in victims for e in v.extents)
        if free < pages:
            chosen = {k for k, _ in victims}
            for key, entry in self._index.eviction_order(unpinned):
                if free >= pages:
                    break
                if key not in chosen:
                    victims.append((key, entry))
                    free += sum(e.pages for e in entry.extents)
        for key, entry in victims:
            self._index.remove(key)
            entry.pins, entry.dead = 1, True
        return victims

    def _state_excess(self, state_bytes: int) -> int:
        return self._index.state_bytes + self._state_reserved + state_bytes - self.state_budget_bytes

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._allocator.free(entry.extents)

    # -- outside the lock -------------------------------------------------------------------------------------------

    def _ranges(self, extents: tuple[Extent, ...], size: int) -> list[tuple[int, int]]:
        """(byte offset, length) of each extent, the last one cut to the record's end."""
        ranges, left = [], size
        for start, pages in extents:
            n = min(pages * self.page_bytes, left)
            ranges.append((start * self.page_bytes, n))
            left -= n
        return ranges

    def _write(self, extents: tuple[Extent, ...], record: memoryview) -> None:
        self._memory.write(self._ranges(extents, len(record)), record)

    def _read(self, entry: _Entry) -> bytearray:
        return self._memory.read(self._ranges(entry.extents, entry.record_bytes), entry.record_bytes)

    def check(self) -> None:
        """Integrity: index totals, allocator structure, caps, and every live page accounted to one owner."""
        with self._lock:
            self._index.check()
            self._allocator.check()
            live = sum(p for _, e in self._index.items() for _, p in e.extents)
            assert live + self._allocator.free_pages <= self._allocator.total_pages
            assert self._index.used_bytes <= self.capacity_bytes
            assert self._index.state_bytes <= self.state_budget_bytes
