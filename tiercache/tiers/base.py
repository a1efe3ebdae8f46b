"""The tier contract, written once, as the protocols a tier implements in fact. The store is the only caller (the
layers table in docs/architecture.md lets no other layer import `tiers`; tests/test_architecture.py holds it).

A tier stores *records* (see record.encoding) under ChunkKeys. It is mechanism only: it keeps its own recency order
and capacity, and hands back what it evicted; whether evicted records move down, and whether hits move up, is the
store's decision. Four protocols, each a capability the store checks with `isinstance` against the protocol (never a
concrete class, never a probe method):
- `Tier` — every tier (host, GPU, disk, Redis): put, get, get_many, contains, delete, touch, usage, close, and three
  attributes that say how the store treats it.
- `ChainDirectory` — a tier that keeps an index (tiercache.tiers.index: GPU, host, disk): the children of a parent
  (what the Lookup call searches for checkpoints), orphans of a lost parent, and `needed_above`. Redis has none.
- `HandsDown` — a tier whose victims stay readable until the store has placed them below (the arenas: GPU, host;
  the disk tier).
- `MappableArena` — the arena same-host clients map (the host tier's in /dev/shm): reservations and pins in place.
  The store's same-host path (tiercache.store.same_host) is what uses it.
tests/tiers/test_contract.py runs the contract against every tier and checks each against the protocols it claims.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.tiers.index import ChunkIndex

if TYPE_CHECKING:
    from tiercache.tiers.arena import Pinned, Reservation


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


@runtime_checkable
class Tier(Protocol):
    """Every tier. Every method is thread-safe; reads (get, get_many, contains) of a tier that is down raise TierDown,
    which the store turns into a miss.

    - put(key, record, return_evicted): store a copy of `record`, replacing any record under `key`. To make room the
      tier evicts records and returns them, with their bytes when `return_evicted` is true (so the store can demote
      them) and `record=None` otherwise (and for unreachable ones: `reachable=False`). A ChainDirectory evicts through
      its index's one policy (chain-aware, states under their own byte budget by value); Redis evicts by its own
      maxmemory policy. Raises TierFull when the record cannot fit at all (larger than the tier or its state budget,
      or every candidate victim is being read), and TierDown when the backend is unreachable. After put returns, the
      tier holds no more than its capacity and its state budget. One record a call: what a put evicts is demoted
      before the next is placed, and the transports place each chunk as its bytes complete (batching puts would hold
      a request's records in memory).
    - get(key): a copy of the record, or None. Marks the key most recently used. The record may be corrupt; callers
      verify.
    - get_many(keys): get for each key, in order: one round trip where a tier pays per call (Redis); a loop for the
      tiers in this process (the default below).
    - contains(keys): one bool per key, without reading records or changing recency.
    - delete(keys): remove what exists, return how many were removed. Deleting a missing key is not an error.
    - touch(keys): mark the keys held most recently used (and read once more), without reading them (a no-op where
      the backend keeps its own recency: Redis).
    - usage(): a TierUsage snapshot.
    - close(): release resources; idempotent.

    Three attributes tell the store how to treat a tier (data, not capability probes):
    - checksum_on_read: records that crossed a disk or network are verified on every read; records that never left
      this process's memory are trusted.
    - shared_by_nodes: other servers read this tier too (Redis), so a promotion copies rather than moves the record, a
      write-through copies every put there, and it has no per-namespace view.
    - codec: how records are stored there (tiercache.record.codec; 0 = raw). The store transcodes records on their
      way in.
    """

    name: str
    checksum_on_read: bool
    shared_by_nodes: bool
    codec: int

    def put(self, key: ChunkKey, record, *, return_evicted: bool) -> list[Evicted]: ...

    def get(self, key: ChunkKey) -> bytes | bytearray | None: ...

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | bytearray | None]:
        return [self.get(key) for key in keys]

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    def touch(self, keys: Sequence[ChunkKey]) -> None: ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...


@runtime_checkable
class ChainDirectory(Protocol):
    """A tier's directory of chains: children by parent, from the index it keeps (tiercache.tiers.index).

    - children(parent): the keys (and metas) of the records held whose parent is `parent`: the directory the Lookup
      call searches for checkpoints.
    - orphan(parent): the store lost `parent` for good; records descending from it become unreachable and are evicted
      first. Returns how many.
    - needed_above (set by the store): needed_above(key) says whether a tier above holds a child of `key`; the tier
      then keeps `key` (a chain shrinks from its deep end across tiers too). Called under the tier's lock; it takes
      the locks of tiers above it only.
    - entries(namespaces): the keys (and metas) held in those namespaces: the inventory KV events start from (a
      server restarted over its disk tier, a pod registered after its saves).
    """

    needed_above: Callable[[ChunkKey], bool]

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, ChunkMeta]]: ...

    def entries(self, namespaces: frozenset[str]) -> list[tuple[ChunkKey, ChunkMeta]]: ...

    def orphan(self, parent: ChunkKey) -> int: ...


@runtime_checkable
class HandsDown(Protocol):
    """A tier that frees its victims' room only after they are placed below (the arenas, the disk tier).

    hand_down (set by the store): hand_down(evicted) places what a put or reservation evicts in the tiers below while
    the victims are still readable in this tier, before their pages are reused; put and reserve then return no
    victims. So a chunk on its way down is always in a tier (without it, a read between the eviction and the demotion
    missed: tests/server/test_data_channel.py). Called without the tier's lock. None (the default): victims are
    returned, as Tier.put says.
    """

    hand_down: Callable[[list[Evicted]], None] | None


@runtime_checkable
class MappableArena(Tier, Protocol):
    """A tier whose arena same-host clients map to write and read records in place (the host tier's, in /dev/shm). Its
    reservations and pins name their `payload_ranges` in `arena`; tiercache.store.same_host uses them.

    - arena: the file clients map (an ArenaFile: path, size, inode).
    - reserve(key, size, meta, return_evicted): room for a record of `size` bytes, invisible until committed;
      returns the reservation and what it evicted (as Tier.put). TierFull when there is no room.
    - commit(reservation): write the record's header over the reservation's front (unsealed: memory records are
      trusted) and make it visible. abort(reservation): free it.
    - pin(key): hold a record in place for a reader until unpin (its pages are not reused meanwhile), or None when
      the arena does not hold it.
    - views(ranges): the arena's bytes at reserved or pinned ranges, in place.
    """

    arena: ArenaFile

    def reserve(self, key: ChunkKey, size: int, meta: ChunkMeta, *,
                return_evicted: bool) -> tuple["Reservation", list[Evicted]]: ...

    def commit(self, reservation: "Reservation") -> None: ...

    def abort(self, reservation: "Reservation") -> None: ...

    def pin(self, key: ChunkKey) -> "Pinned | None": ...

    def unpin(self, pinned: "Pinned") -> None: ...

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]: ...


class IndexedTier(Tier):
    """The Tier and ChainDirectory methods every tier that keeps a ChunkIndex (GPU, host, disk) answers from it,
    written once. The tier provides `_lock`, `_index`, `capacity_bytes` and `state_budget_bytes`."""

    _lock: threading.Lock
    _index: ChunkIndex
    capacity_bytes: int
    state_budget_bytes: int
    needed_above: Callable[[ChunkKey], bool] = staticmethod(_nothing_above)  # the store sets it (ChainDirectory)

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

    def entries(self, namespaces: frozenset[str]) -> list[tuple[ChunkKey, ChunkMeta]]:
        with self._lock:
            return [(key, entry.meta) for key, entry in self._index.items() if key.namespace in namespaces]
