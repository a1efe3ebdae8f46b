"""A tier over one preallocated memory arena of fixed-size pages: the host tier (RAM) and the GPU tier (device).

The arena is allocated once at start, never per chunk: fresh memory costs a page fault per 4 KiB on first touch
(1-2 GB/s on our machines against ~12 GB/s into reused memory), and a dict of `bytes` would fragment the heap.
Records are placed by tiercache.tiers.allocator (one page of waste per record at most). The memory itself is a small
object with read / write / close (`ArenaMemory`); everything else — index, eviction, pins, budgets — is here, once.

Copies in and out of the arena happen outside the metadata lock. A reader pins its entry, so the pages it is copying
cannot be reused by a concurrent put until it unpins; a record replaced or deleted while pinned frees its pages when
the last reader leaves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from tiercache.config import state_budget
from tiercache.errors import TierFull
from tiercache.record import encoding
from tiercache.record.codec import RAW
from tiercache.record.keys import ChunkKey
from tiercache.tiers.allocator import Extent, ExtentAllocator
from tiercache.tiers.base import ArenaFile, Evicted, IndexedTier, Ranges
from tiercache.tiers.index import ChunkIndex, Victim, parent_of


@dataclass(slots=True)
class _Pages:
    """A record held in the arena (the index's entry): the pages it lies in, and the readers pinning them."""

    record_bytes: int
    meta: encoding.ChunkMeta
    extents: tuple[Extent, ...]
    pins: int = 0
    dead: bool = False  # removed from the index while pinned: free the pages at the last unpin


class ArenaMemory(Protocol):
    """Where an arena's bytes live. Offsets and sizes are in bytes; ranges never overlap a concurrent write."""

    def write(self, ranges: Sequence[tuple[int, int]], record: memoryview) -> None: ...

    def read(self, ranges: Sequence[tuple[int, int]], size: int) -> bytearray: ...

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Zero-copy views of ranges (host memory only; the GPU arena raises NotImplementedError)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Reservation:
    key: ChunkKey
    size: int  # record bytes: header + payload
    meta: encoding.ChunkMeta
    extents: tuple[Extent, ...]
    ranges: Ranges  # (byte offset, length) in the arena, in record order

    @property
    def payload_ranges(self) -> list[tuple[int, int]]:
        """Where the client writes the payload (after the header that commit writes)."""
        return _payload_ranges(self.key, self.meta, self.ranges)


@dataclass(frozen=True)
class Pinned:
    key: ChunkKey
    meta: encoding.ChunkMeta
    size: int
    ranges: Ranges
    entry: object = field(repr=False, compare=False)

    @property
    def payload_ranges(self) -> list[tuple[int, int]]:
        """Where a same-host reader copies the payload from."""
        return _payload_ranges(self.key, self.meta, self.ranges)


def _pages(entry: _Pages) -> int:
    return sum(pages for _, pages in entry.extents)


def _cut(ranges: Sequence[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The part of a record's ranges before byte `end`."""
    out, left = [], end
    for offset, n in ranges:
        if left <= 0:
            break
        out.append((offset, min(n, left)))
        left -= n
    return out


def _shift(ranges: Sequence[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """The part of a record's ranges from byte `start` on (e.g. the payload after the header)."""
    out, skip = [], start
    for offset, n in ranges:
        if skip >= n:
            skip -= n
            continue
        out.append((offset + skip, n - skip))
        skip = 0
    return out


def _payload_ranges(key: ChunkKey, meta: encoding.ChunkMeta, ranges: Ranges) -> list[tuple[int, int]]:
    return _shift(ranges, encoding.header_bytes(key, meta))


class ArenaTier(IndexedTier):
    """A Tier, a ChainDirectory (its index) and HandsDown (its victims stay readable until placed below)."""

    checksum_on_read = False  # the bytes never leave this process's memory
    shared_by_nodes = False
    codec = RAW  # memory tiers hold raw records: readers copy payloads straight out
    # Set by the store: places what a put or reservation evicts below this tier *before* the victims' pages are
    # freed (see _let_go); put and reserve then return no victims. None: they return them (the contract's default).
    hand_down: Callable[[list[Evicted]], None] | None = None  # (HandsDown)

    def __init__(self, name: str, memory: ArenaMemory, capacity_bytes: int, page_bytes: int,
                 state_budget_bytes: int | None, state_value_weight: float) -> None:
        self.name = name
        self.page_bytes = page_bytes
        pages = capacity_bytes // page_bytes
        self.capacity_bytes = pages * page_bytes
        self.state_budget_bytes = min(state_budget(capacity_bytes, state_budget_bytes), self.capacity_bytes)
        self._memory = memory
        self._allocator = ExtentAllocator(pages)
        self._index: ChunkIndex[_Pages] = ChunkIndex(state_value_weight)
        self._leaving: dict[ChunkKey, _Pages] = {}  # victims being copied out and handed down: still readable
        self._lock = threading.Lock()

    # -- contract ---------------------------------------------------------------------------------------------------

    def put(self, key: ChunkKey, record, *, return_evicted: bool) -> list[Evicted]:
        record = memoryview(record).cast("B")
        meta = encoding.read_meta(record)
        extents, evicted = self._allocate(key, len(record), meta, return_evicted)
        self._write(extents, record)
        self._commit_entry(key, len(record), meta, extents)
        return evicted

    def _allocate(self, key: ChunkKey, size: int, meta: encoding.ChunkMeta,
                  return_evicted: bool) -> tuple[tuple[Extent, ...], list[Evicted]]:
        """Pages for a record, evicting as needed; counts it against the state budget until _commit_entry."""
        state = size if meta.object_class == encoding.CLASS_STATE else 0
        pages = -(-size // self.page_bytes)
        if pages > self._allocator.total_pages or state > self.state_budget_bytes:
            raise TierFull(f"{size} bytes exceed what the {self.name} tier may hold")
        evicted: list[Evicted] = []
        with self._lock:
            self._unlink(key)
        while True:
            with self._lock:
                victims = self._choose_victims(key, meta, pages, state)
                fits = not victims and self._index.state_excess(state, self.state_budget_bytes) <= 0
                extents = self._allocator.allocate(pages) if fits else None
                if extents is not None:
                    self._index.state_reserved += state
                    return extents, evicted
            if not victims:  # everything left is being read right now
                raise TierFull(f"{self.name} tier has no room for {size} bytes right now", evicted)
            self._let_go(victims, evicted, return_evicted)

    def _let_go(self, victims: list[Victim[_Pages]], evicted: list[Evicted], return_evicted: bool) -> None:
        """Copy victims out (without the lock: they are pinned) and hand them down, or add them to `evicted`; then
        free their pages. Until then a victim stays readable here (`_leaving`): with `hand_down` set, a chunk on its
        way to the tier below is in one tier or the other at every moment. (A victim used to be in no tier
        from its eviction until the store had written it below, and a read then missed it on every path;
        tests/server/test_data_channel.py reproduces it with stalled puts whose reservations evict again and again.)"""
        try:
            batch = [Evicted(v.key, self._read(v.entry) if return_evicted and v.reachable else None, v.reachable)
                     for v in victims]
            if self.hand_down is None:
                evicted.extend(batch)
            else:
                self.hand_down(batch)
        finally:
            with self._lock:
                for victim in victims:
                    if self._leaving.get(victim.key) is victim.entry:
                        del self._leaving[victim.key]
                    self._unpin(victim.entry)  # frees their pages; the next round allocates (or evicts more if raced)

    def _commit_entry(self, key: ChunkKey, size: int, meta: encoding.ChunkMeta, extents: tuple[Extent, ...]) -> None:
        with self._lock:
            if meta.object_class == encoding.CLASS_STATE:
                self._index.state_reserved -= size
            self._unlink(key)  # a concurrent put of the same key may have committed meanwhile: last one wins
            self._index.add(key, _Pages(size, meta, extents))

    def get(self, key: ChunkKey) -> bytearray | None:
        with self._lock:
            entry = self._found(key)
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
            return [k in self._index or k in self._leaving for k in keys]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return sum(self._unlink(k) for k in keys)

    def close(self) -> None:
        with self._lock:
            self._memory.close()

    # -- inside the lock --------------------------------------------------------------------------------------------

    def _found(self, key: ChunkKey) -> _Pages | None:
        """A record held here for a reader: in the index (marked used), or evicted and still on its way down."""
        entry = self._index.touch(key)
        return entry if entry is not None else self._leaving.get(key)

    def _unlink(self, key: ChunkKey) -> bool:
        entry = self._index.remove(key)
        if entry is None:
            return False
        if entry.pins:
            entry.dead = True
        else:
            self._allocator.free(entry.extents)
        return True

    def _choose_victims(self, key: ChunkKey, meta: encoding.ChunkMeta, pages: int,
                        state_bytes: int) -> list[Victim[_Pages]]:
        """Unlink what the index says goes first until the record for `key` of `pages` (and `state_bytes` of state
        budget) would fit; pin them for the copy-out. Entries being read stay."""
        victims = self._index.victims(pages - self._allocator.free_pages,
                                      self._index.state_excess(state_bytes, self.state_budget_bytes),
                                      units=_pages, evictable=lambda e: e.pins == 0, keep=parent_of(key, meta),
                                      needed_above=self.needed_above)
        for victim in victims:
            victim.entry.pins, victim.entry.dead = 1, True
            self._leaving[victim.key] = victim.entry
        return victims

    def _unpin(self, entry: _Pages) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._allocator.free(entry.extents)

    # -- outside the lock -------------------------------------------------------------------------------------------

    def _ranges(self, extents: tuple[Extent, ...], size: int) -> tuple[tuple[int, int], ...]:
        """(byte offset, length) of each extent, the last one cut to the record's end."""
        ranges, left = [], size
        for start, pages in extents:
            n = min(pages * self.page_bytes, left)
            ranges.append((start * self.page_bytes, n))
            left -= n
        return tuple(ranges)

    def _write(self, extents: tuple[Extent, ...], record: memoryview) -> None:
        self._memory.write(self._ranges(extents, len(record)), record)

    def _read(self, entry: _Pages) -> bytearray:
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


class MappedArenaTier(ArenaTier):
    """An ArenaTier whose memory is a file same-host clients map (the host tier in /dev/shm): a MappableArena too.
    The client copies payloads itself, at a reservation's or a pin's ranges (tiercache.store.same_host)."""

    def __init__(self, name: str, memory: ArenaMemory, arena: ArenaFile, capacity_bytes: int, page_bytes: int,
                 state_budget_bytes: int | None, state_value_weight: float) -> None:
        super().__init__(name, memory, capacity_bytes, page_bytes, state_budget_bytes, state_value_weight)
        self.arena = arena

    def reserve(self, key: ChunkKey, size: int, meta: encoding.ChunkMeta, *,
                return_evicted: bool) -> tuple["Reservation", list[Evicted]]:
        """Room for a record of `size` bytes, invisible until `commit` (or freed by `abort`)."""
        extents, evicted = self._allocate(key, size, meta, return_evicted)
        return Reservation(key, size, meta, extents, self._ranges(extents, size)), evicted

    def commit(self, reservation: "Reservation") -> None:
        """Write the record's header over the reserved front and make it visible. The header is left unsealed:
        memory records are trusted, and the store seals a record when it leaves for a verifying tier."""
        start = encoding.header_bytes(reservation.key, reservation.meta)
        payload = self._memory.views(_shift(reservation.ranges, start))
        head = encoding.header(reservation.key, reservation.meta, payload, seal=False)
        self._memory.write(_cut(reservation.ranges, start), memoryview(head))
        self._commit_entry(reservation.key, reservation.size, reservation.meta, reservation.extents)

    def abort(self, reservation: "Reservation") -> None:
        with self._lock:
            self._allocator.free(reservation.extents)
            if reservation.meta.object_class == encoding.CLASS_STATE:
                self._index.state_reserved -= reservation.size

    def pin(self, key: ChunkKey) -> "Pinned | None":
        """Hold a record in place for a same-host reader until `unpin`: its pages are not reused meanwhile."""
        with self._lock:
            entry = self._found(key)
            if entry is None:
                return None
            entry.pins += 1
        return Pinned(key, entry.meta, entry.record_bytes, self._ranges(entry.extents, entry.record_bytes), entry)

    def unpin(self, pinned: "Pinned") -> None:
        with self._lock:
            self._unpin(pinned.entry)

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """The arena's bytes at reserved or pinned ranges, in place (the data channel's listener receives into and sends
        from them)."""
        return self._memory.views(ranges)
