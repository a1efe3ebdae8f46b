"""The tier contract, written once. Host, disk and Redis implement it; the store is the only caller.

A tier stores *records* (see record.encoding) under ChunkKeys. It is mechanism only: it keeps its own recency order
and capacity, and hands back what it evicted; whether evicted records move down, and whether hits move up, is the
store's decision.

Contract (every method is thread-safe):
- put(key, record, return_evicted): store a copy of `record`, replacing any record under `key`. To make room the
  tier evicts records and returns them, with their bytes when `return_evicted` is true (so the store can demote
  them) and `record=None` otherwise (and for unreachable ones: `reachable=False`). Tiers with an index evict through
  its one policy (tiercache.tiers.index: chain-aware, states under their own byte budget by value); Redis evicts by
  its own maxmemory policy. Raises TierFull
  when the record cannot fit at all (larger than the tier or its state budget, or every candidate victim is being
  read), and TierDown when the backend is unreachable. After put returns, the tier holds no more than its capacity
  and its state budget.
- get(key): a copy of the record, or None. Marks the key most recently used. The record may be corrupt; callers verify.
- contains(keys): one bool per key, without reading records or changing recency.
- delete(keys): remove what exists, return how many were removed. Deleting a missing key is not an error.
- usage(): a TierUsage snapshot.
- touch(keys): mark the keys held most recently used (and read once more), without reading them. A no-op for a tier
  that keeps no index.
- children(parent): the keys (and metas) of the records held whose parent is `parent`: the directory the Lookup call
  searches for checkpoints. [] for a tier that keeps no index (Redis).
- orphan(parent): the store lost `parent` for good; records descending from it become unreachable and are evicted
  first. A no-op for a tier that keeps no index.
- needed_above (an attribute of an IndexedTier, set by the store): needed_above(key) says whether a tier above
  holds a child of `key`; the tier then keeps `key` (tiercache.tiers.index: a chain shrinks from its deep end across
  tiers too). Called under the tier's lock; it takes the locks of tiers above it only.
- hand_down (an attribute of an ArenaTier, set by the store): hand_down(evicted) places what a put or reservation
  evicts in the tiers below while the victims are still readable in this one, before their pages are reused; put
  and reserve then return no victims. So a chunk on its way down is always in a tier (issue 26: without it, a read
  between the eviction and the demotion missed). Called without the tier's lock.
- arena_file(): the file same-host clients may map to write and read records in place (the host tier's arena in
  /dev/shm), or None. A tier that returns one also implements reserve / commit / abort / pin / unpin (ArenaTier), and
  its reservations and pins name their `payload_ranges` in that file; the store's same-host path
  (tiercache.store.same_host) is their only caller.
- close(): release resources; idempotent.
Reads (get, contains) of a tier that is down raise TierDown; the store turns that into a miss.

Two attributes tell the store how to treat a tier (data, not capability probes):
- checksum_on_read: records that crossed a disk or network are verified on every read; records that never left
  this process's memory are trusted.
- shared_by_nodes: other servers read this tier too (Redis), so a promotion copies rather than moves the record, a
  write-through copies every put there, and it has no per-namespace view.
- codec: how records are stored there (tiercache.record.codec; 0 = raw). The store transcodes records on their way in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.tiers.index import ChunkIndex


@dataclass(frozen=True, slots=True)
class Evicted:
    key: ChunkKey
    record: bytes | bytearray | None
    reachable: bool = True  # False: an orphan of a lost chain (tiercache.tiers.index), not worth demoting


Ranges = tuple[tuple[int, int], ...]  # (byte offset, length) pairs in a file or arena, in order


@dataclass(frozen=True)
class ArenaFile:
    """The file a same-host client maps to write and read records in place; it proves it has the very file by its
    inode."""

    path: str
    size_bytes: int
    inode: int


@dataclass(frozen=True)
class TierUsage:
    chunks: int
    used_bytes: int
    capacity_bytes: int  # 0 when the backend bounds itself (Redis without maxmemory)
    up: bool = True
    state_chunks: int = 0
    state_bytes: int = 0
    state_budget_bytes: int = 0  # 0 when states have no budget of their own here (Redis)
    bytes_by_namespace: dict[str, int] = field(default_factory=dict)
    chunks_by_namespace: dict[str, int] = field(default_factory=dict)


def _nothing_above(key: ChunkKey) -> bool:
    return False


class IndexedTier:
    """The contract methods every tier that keeps a ChunkIndex (GPU, host, disk) answers from it, written once.
    The tier provides `_lock`, `_index`, `capacity_bytes` and `state_budget_bytes`."""

    _lock: threading.Lock
    _index: ChunkIndex
    capacity_bytes: int
    state_budget_bytes: int
    needed_above: Callable[[ChunkKey], bool] = staticmethod(_nothing_above)  # the store sets it (see above)

    def usage(self) -> TierUsage:
        with self._lock:
            index = self._index
            return TierUsage(len(index), index.used_bytes, self.capacity_bytes, state_chunks=index.state_chunks,
                             state_bytes=index.state_bytes, state_budget_bytes=self.state_budget_bytes,
                             bytes_by_namespace=dict(index.bytes_by_namespace),
                             chunks_by_namespace=dict(index.chunks_by_namespace))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for key in keys:
                self._index.touch(key)

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, ChunkMeta]]:
        with self._lock:
            return [(key, entry.meta) for key, entry in self._index.children(parent)]

    def orphan(self, parent: ChunkKey) -> int:
        with self._lock:
            return self._index.orphan(parent)


class Tier(Protocol):
    name: str
    checksum_on_read: bool
    shared_by_nodes: bool
    codec: int

    def put(self, key: ChunkKey, record, *, return_evicted: bool) -> list[Evicted]: ...

    def get(self, key: ChunkKey) -> bytes | bytearray | None: ...

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    def usage(self) -> TierUsage: ...

    def touch(self, keys: Sequence[ChunkKey]) -> None: ...

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, ChunkMeta]]:
        """The chunks held here whose parent is `parent` (the directory; [] for a tier without one)."""
        ...

    def orphan(self, parent: ChunkKey) -> int:
        """`parent` is gone from the store: what descends from it here is unreachable (evicted first)."""
        ...

    def arena_file(self) -> ArenaFile | None:
        """The file same-host clients may map (see the module docstring), or None."""
        ...

    def close(self) -> None: ...
