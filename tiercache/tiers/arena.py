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

from dataclasses import dataclass
from typing import Protocol, Sequence

from tiercache.config import state_budget
from tiercache.record import encoding
from tiercache.record.codec import RAW
from tiercache.record.keys import ChunkKey
from tiercache.tiers.allocator import Extent, ExtentAllocator
from tiercache.tiers.base import ArenaFile, Pinned, Reservation, Room, ranges_before, ranges_from
from tiercache.tiers.index import ChunkIndex
from tiercache.tiers.indexed import IndexedTier


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


class ArenaTier(IndexedTier[_Pages]):
    """A Tier and a ChainDirectory (its index) over pages: a victim is pinned while it leaves, so its pages are not
    reused until the store has placed it below and released the room."""

    checksum_on_read = False  # the bytes never leave this process's memory
    shared_by_nodes = False
    codec = RAW  # memory tiers hold raw records: readers copy payloads straight out

    def __init__(self, name: str, memory: ArenaMemory, capacity_bytes: int, page_bytes: int,
                 state_budget_bytes: int | None, state_value_weight: float) -> None:
        pages = capacity_bytes // page_bytes
        super().__init__(ChunkIndex(state_value_weight), pages * page_bytes,
                         min(state_budget(capacity_bytes, state_budget_bytes), pages * page_bytes))
        self.name = name
        self.page_bytes = page_bytes
        self._memory = memory
        self._allocator = ExtentAllocator(pages)

    # -- contract ---------------------------------------------------------------------------------------------------

    def put(self, room: Room, record) -> None:
        record = memoryview(record).cast("B")
        self._memory.write(self._ranges(room.claim, len(record)), record)
        self._commit(room)

    def get(self, key: ChunkKey) -> bytearray | None:
        with self._lock:
            entry = self._found(key)
            if entry is None:
                return None
            entry.pins += 1
        try:
            return self._read_entry(entry)
        finally:
            with self._lock:
                self._unpin(entry)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return sum(self._unlink(k) for k in keys)

    def close(self) -> None:
        with self._lock:
            self._memory.close()

    def _commit(self, room: Room) -> None:
        """The written room becomes the record for its key (a concurrent put of the same key may have committed
        meanwhile: last one wins)."""
        with self._lock:
            self._index.state_reserved -= room.state_bytes
            self._unlink(room.key)
            self._index.add(room.key, _Pages(room.size, room.meta, room.claim))
            room.claim = None

    # -- the room (IndexedTier's hooks) -----------------------------------------------------------------------------

    def _claim(self, size: int, state: int) -> tuple[Extent, ...] | None:
        if self._index.state_excess(state, self.state_budget_bytes) > 0:
            return None
        extents = self._allocator.allocate(self._pages_for(size))
        if extents is not None:
            self._index.state_reserved += state  # counted against the budget until committed or given back
        return extents

    def _shortfall(self, size: int) -> int:
        return self._pages_for(size) - self._allocator.free_pages

    @staticmethod
    def _units(entry: _Pages) -> int:
        return sum(pages for _, pages in entry.extents)

    @staticmethod
    def _evictable(entry: _Pages) -> bool:
        return entry.pins == 0  # entries being read stay

    def _hold(self, entry: _Pages) -> None:
        entry.pins, entry.dead = 1, True  # pinned for the copy-out; freed at the last unpin

    def _let_go(self, entry: _Pages) -> None:
        self._unpin(entry)

    def _unclaim(self, claim: tuple[Extent, ...], size: int, state: int) -> None:
        self._allocator.free(claim)
        self._index.state_reserved -= state

    def _drop(self, key: ChunkKey) -> None:
        with self._lock:
            self._unlink(key)

    def _read_entry(self, entry: _Pages) -> bytearray:
        return self._memory.read(self._ranges(entry.extents, entry.record_bytes), entry.record_bytes)

    def _pages_for(self, size: int) -> int:
        return -(-size // self.page_bytes)

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

    def reserve(self, room: Room) -> Reservation:
        """A ready room as a reservation clients write in place, invisible until `commit` (or given back by
        `abort`)."""
        return Reservation(room, self._ranges(room.claim, room.size))

    def commit(self, reservation: Reservation) -> None:
        """Write the record's header over the reserved front and make it visible. The header is left unsealed:
        memory records are trusted, and the store seals a record when it leaves for a verifying tier."""
        start = encoding.header_bytes(reservation.key, reservation.meta)
        payload = self._memory.views(ranges_from(reservation.ranges, start))
        head = encoding.header(reservation.key, reservation.meta, payload, seal=False)
        self._memory.write(ranges_before(reservation.ranges, start), memoryview(head))
        self._commit(reservation.room)

    def abort(self, reservation: Reservation) -> None:
        self.release(reservation.room)

    def pin(self, key: ChunkKey) -> Pinned | None:
        """Hold a record in place for a same-host reader until `unpin`: its pages are not reused meanwhile."""
        with self._lock:
            entry = self._found(key)
            if entry is None:
                return None
            entry.pins += 1
        return Pinned(key, entry.meta, entry.record_bytes, self._ranges(entry.extents, entry.record_bytes), entry)

    def unpin(self, pinned: Pinned) -> None:
        with self._lock:
            self._unpin(pinned.entry)

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """The arena's bytes at reserved or pinned ranges, in place (the data channel's listener receives into and sends
        from them)."""
        return self._memory.views(ranges)
