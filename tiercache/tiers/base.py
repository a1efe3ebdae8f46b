"""The tier contract, written once, as the protocols a tier implements in fact. The store is the only caller (the
layers table in docs/architecture.md lets no other layer import `tiers`; tests/test_architecture.py holds it).

A tier stores *records* (see record.encoding) under ChunkKeys. It is mechanism only: it keeps its own recency order
and capacity, and says what it would evict to take a record; whether those victims move down, and whether hits move
up, is the store's decision. Eviction flows one way, store -> tier: no tier calls the store. Three protocols, each a
capability the store checks with `isinstance` against the protocol (never a concrete class, never a probe method):
- `Tier` — every tier (host, GPU, disk, Redis): make_room, put, release, get, get_many, contains, delete, touch,
  usage, close, and three attributes that say how the store treats it.
- `ChainDirectory` — a tier that keeps an index (tiercache.tiers.index, through tiercache.tiers.indexed: GPU, host,
  disk): the children of a parent (what the Lookup call searches for checkpoints), orphans of a lost parent. Redis
  has none.
- `MappableArena` — the arena same-host clients map (the host tier's in /dev/shm): reservations and pins in place.
  The store's same-host path (tiercache.store.same_host) is what uses it.
tests/tiers/test_contract.py runs the contract against every tier `tiers.from_config` builds, and checks each against
the protocols it claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

from tiercache.record import encoding
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey


@dataclass(frozen=True, slots=True)
class Evicted:
    key: ChunkKey
    record: bytes | bytearray | None
    reachable: bool = True  # False: an orphan of a lost chain (tiercache.tiers.index), not worth demoting


@dataclass(slots=True, eq=False)
class Room:
    """Room for one record of `size` bytes in one tier: what `Tier.make_room` answers. One of three:
    - ready (`claim` set): the tier holds the room; `put` writes the record into it, or `release` gives it back;
    - victims (`evicted`): the tier took these out of its index to make the room. They stay readable there until
      `release`, so a chunk on its way down is in some tier at every moment (tests/tiers/test_contract.py holds it);
      the store places them below, releases the room, and asks again;
    - refused (neither): the tier cannot make the room now (`reason`); the store tries the tier below.
    """

    key: ChunkKey
    meta: ChunkMeta
    size: int
    claim: object | None = None  # the tier's hold on the room (arena pages, reserved disk bytes)
    evicted: list[Evicted] = field(default_factory=list)  # the victims, with their bytes when asked for
    victims: list = field(default_factory=list)  # the tier's own entries behind `evicted`
    reason: str = ""

    @property
    def ready(self) -> bool:
        return self.claim is not None

    @property
    def state_bytes(self) -> int:
        """What the record counts against the tier's state budget."""
        return self.size if self.meta.object_class == encoding.CLASS_STATE else 0


Ranges = tuple[tuple[int, int], ...]  # (byte offset, length) pairs in a file or arena, in order
NeededAbove = Callable[[ChunkKey], bool]  # whether a tier above holds a child of a key (Tier.make_room)


def ranges_before(ranges: Sequence[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The part of a record's ranges before byte `end` (e.g. its header)."""
    out, left = [], end
    for offset, n in ranges:
        if left <= 0:
            break
        out.append((offset, min(n, left)))
        left -= n
    return out


def ranges_from(ranges: Sequence[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """The part of a record's ranges from byte `start` on (e.g. the payload after the header)."""
    out, skip = [], start
    for offset, n in ranges:
        if skip >= n:
            skip -= n
            continue
        out.append((offset + skip, n - skip))
        skip = 0
    return out


@dataclass(frozen=True)
class ArenaFile:
    """The file a same-host client maps to write and read records in place; it proves it has the very file by its
    inode."""

    path: str
    size_bytes: int
    inode: int


@dataclass(frozen=True)
class Reservation:
    """A ready Room in a MappableArena, at `ranges` of its file: invisible until committed."""

    room: Room = field(repr=False)
    ranges: Ranges  # (byte offset, length) in the arena, in record order

    @property
    def key(self) -> ChunkKey:
        return self.room.key

    @property
    def meta(self) -> ChunkMeta:
        return self.room.meta

    @property
    def size(self) -> int:
        """Record bytes: header + payload."""
        return self.room.size

    @property
    def payload_ranges(self) -> list[tuple[int, int]]:
        """Where the client writes the payload (after the header that commit writes)."""
        return ranges_from(self.ranges, encoding.header_bytes(self.key, self.meta))


@dataclass(frozen=True)
class Pinned:
    """A record held in place in a MappableArena for a reader until unpinned."""

    key: ChunkKey
    meta: ChunkMeta
    size: int
    ranges: Ranges
    entry: object = field(repr=False, compare=False)

    @property
    def payload_ranges(self) -> list[tuple[int, int]]:
        """Where a same-host reader copies the payload from."""
        return ranges_from(self.ranges, encoding.header_bytes(self.key, self.meta))


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


@runtime_checkable
class Tier(Protocol):
    """Every tier. Every method is thread-safe; reads (get, get_many, contains) of a tier that is down raise TierDown,
    which the store turns into a miss.

    - make_room(key, meta, size_bytes, read_victims, needed_above): a Room for a record of `size_bytes` (see Room).
      A tier with an index takes victims through its one policy (chain-aware, states under their own byte budget by
      value: tiers/index.py), with their bytes when `read_victims` (the store demotes them; unreachable ones come
      without), and keeps a leaf for which `needed_above(key)` says a tier above holds a child of it (a chain shrinks
      from its deep end across tiers too; the store asks its tiers above, under this tier's lock, taking the locks of
      tiers above it only); it drops an older record under `key` first. Redis answers ready at once: it evicts by its
      own maxmemory policy. After a put into a ready room the tier holds no more than its capacity and its state
      budget.
    - put(room, record): write `record` (of the room's size) into a ready room; the room is used up. Raises
      TierWriteFailed when the medium refuses the write (the room is given back), TierDown when unreachable.
    - release(room): give back what a room still holds: its victims (their room is reused from now on) or an unused
      claim. Idempotent.
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

    One record a room: what one put evicts is demoted before the next is placed, and the transports place each chunk
    as its bytes complete (batching puts would hold a request's records in memory).

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

    def make_room(self, key: ChunkKey, meta: ChunkMeta, size_bytes: int, *, read_victims: bool,
                  needed_above: NeededAbove | None = None) -> Room: ...

    def put(self, room: Room, record) -> None: ...

    def release(self, room: Room) -> None: ...

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
    - entries(namespaces): the keys (and metas) held in those namespaces: the inventory KV events start from (a
      server restarted over its disk tier, a pod registered after its saves).
    """

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, ChunkMeta]]: ...

    def entries(self, namespaces: frozenset[str]) -> list[tuple[ChunkKey, ChunkMeta]]: ...

    def orphan(self, parent: ChunkKey) -> int: ...


@runtime_checkable
class MappableArena(Tier, Protocol):
    """A tier whose arena same-host clients map to write and read records in place (the host tier's, in /dev/shm). Its
    reservations and pins name their `payload_ranges` in `arena`; tiercache.store.same_host uses them.

    - arena: the file clients map (an ArenaFile: path, size, inode).
    - reserve(room): a ready Room (from make_room, as for a put) as a Reservation at ranges of the arena, invisible
      until committed.
    - commit(reservation): write the record's header over the reservation's front (unsealed: memory records are
      trusted) and make it visible. abort(reservation): give its room back.
    - pin(key): hold a record in place for a reader until unpin (its pages are not reused meanwhile), or None when
      the arena does not hold it.
    - views(ranges): the arena's bytes at reserved or pinned ranges, in place.
    """

    arena: ArenaFile

    def reserve(self, room: Room) -> Reservation: ...

    def commit(self, reservation: Reservation) -> None: ...

    def abort(self, reservation: Reservation) -> None: ...

    def pin(self, key: ChunkKey) -> Pinned | None: ...

    def unpin(self, pinned: Pinned) -> None: ...

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]: ...
