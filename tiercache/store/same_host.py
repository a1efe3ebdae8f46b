"""The same-host data path, store side: records written and read in place in the arena clients can map.

gRPC carries control only (Attach, Reserve/Commit/Abort, Acquire/Release); the payload never crosses a socket. The
arena is a tier's (the host tier's, in /dev/shm: a tiers.base.MappableArena); this object is the store's view of it:
- a write is *reserved* (room in the arena made as for any put, invisible until committed), written by
  the client at the `WriteGrant`'s payload ranges, then *committed* (the store places it like any put) or *aborted*;
- a read is *pinned* (`ReadGrant`): promoted into the arena first when it lives below, held in place until unpinned.
The server wraps every grant in a lease that expires (tiercache.server.leases), so a client that crashes cannot hold
memory; the client half is tiercache.client.shared_arena.

The path calls the store, one way: the server builds it over the store's first MappableArena (`SameHostPath.over`),
and it asks the store for four things only, `Placement` below (room for a reservation, what a commit changes below,
a hit counted, reads from the tiers below). The store knows nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from tiercache.errors import CapacityExceeded
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import StoredChunk
from tiercache.tiers.base import ArenaFile, MappableArena, Ranges, Room, Tier


class Placement(Protocol):
    """What the same-host path asks of the store (tiercache.store.tiered.TieredStore), and nothing more."""

    tiers: Sequence[Tier]  # fastest first: the path is over the first that is a MappableArena

    def make_room(self, level: int, key: ChunkKey, meta: encoding.ChunkMeta, size: int) -> Room | None:
        """Room in the arena at `level`, what it evicts placed in the tiers below; None when it cannot be made."""

    def after_placement(self, key: ChunkKey, meta: encoding.ChunkMeta, placed: int,
                        record: Callable[[], bytes | bytearray | None]) -> None:
        """A record committed at `placed`: drop older copies below, write through."""

    def count_hit(self, tier: Tier) -> None:
        """A read served from the arena."""

    def get_many(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        """Reads from every tier (promoted to the top on the way)."""


@dataclass(frozen=True)
class WriteGrant:
    """Room for one record in the arena: the client writes the payload at `payload`, then commits or aborts."""

    key: ChunkKey
    payload: Ranges  # (offset, length) in the arena file, in payload order
    reservation: object  # the tier's handle


@dataclass(frozen=True)
class ReadGrant:
    """A chunk found for a same-host reader: pinned in the arena (`pinned`), or not (read it over gRPC)."""

    tier: str  # where it was found
    payload: Ranges  # (offset, length) in the arena file; empty when not pinned
    size_bytes: int  # of the payload
    pin: object | None  # the tier's handle; None: too large for the arena, or held above it by the GPU tier
    copy: memoryview | None = None  # when not pinned: the payload as the store read it

    @property
    def pinned(self) -> bool:
        return self.pin is not None


class SameHostPath:
    """The store's same-host path over the first tier whose arena clients can map (see the module docstring)."""

    def __init__(self, store: Placement, tier: MappableArena, level: int) -> None:
        self._store = store
        self._tier = tier
        self._level = level
        self.arena: ArenaFile = tier.arena

    @classmethod
    def over(cls, store: Placement) -> "SameHostPath | None":
        """The path over the store's first tier whose arena clients can map; None when no tier has one."""
        for level, tier in enumerate(store.tiers):
            if isinstance(tier, MappableArena):
                return cls(store, tier, level)
        return None

    @property
    def on_top(self) -> bool:
        """The arena is the store's first tier (no GPU tier above it): a put placed by the store lands there too."""
        return self._level == 0

    def reserve(self, key: ChunkKey, payload_bytes: int, meta: encoding.ChunkMeta) -> WriteGrant:
        size = encoding.header_bytes(key, meta) + payload_bytes
        room = self._store.make_room(self._level, key, meta, size)
        if room is None:
            raise CapacityExceeded(f"the shared arena has no room for {size} bytes")
        reservation = self._tier.reserve(room)
        return WriteGrant(key, tuple(reservation.payload_ranges), reservation)

    def commit(self, grant: WriteGrant) -> str:
        """Make a written record visible; returns the tier that holds it."""
        reservation = grant.reservation
        self._tier.commit(reservation)
        self._store.after_placement(reservation.key, reservation.meta, self._level,
                                    lambda: self._tier.get(reservation.key))
        return self._tier.name

    def abort(self, grant: WriteGrant) -> None:
        self._tier.abort(grant.reservation)

    def pin(self, keys: Sequence[ChunkKey]) -> list[ReadGrant | None]:
        """Hold each chunk in the arena for a reader, or None when no tier holds it. What lives below is read in one
        store call for the batch (promoted into the arena on the way) and pinned there; what the arena cannot hold
        comes with the store's copy."""
        grants: list[ReadGrant | None] = [None] * len(keys)
        below = []
        for i, key in enumerate(keys):
            pin = self._tier.pin(key)
            if pin is None:
                below.append(i)
                continue
            self._store.count_hit(self._tier)
            grants[i] = _read_grant(self._tier.name, pin)
        if not below:
            return grants
        for i, found in zip(below, self._store.get_many([keys[i] for i in below])):
            if found is None:
                continue
            pin = self._tier.pin(keys[i])
            grants[i] = (ReadGrant(found.tier, (), len(found.payload), None, found.payload) if pin is None
                         else _read_grant(found.tier, pin))
        return grants

    def unpin(self, grant: ReadGrant) -> None:
        self._tier.unpin(grant.pin)

    def views(self, ranges: Ranges) -> list[memoryview]:
        """The arena's bytes at a grant's payload ranges, for a reader or writer inside the server (the transports
        behind tiercache.server.intake receive into and send from them in place)."""
        return self._tier.views(ranges)

def _read_grant(tier: str, pin) -> ReadGrant:
    payload = tuple(pin.payload_ranges)
    return ReadGrant(tier, payload, sum(n for _, n in payload), pin)
