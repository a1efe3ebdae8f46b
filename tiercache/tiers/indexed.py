"""IndexedTier: what every tier that keeps a ChunkIndex (GPU, host, disk) does the same way, written once — making
room (the victim choice, the victims held readable while they leave, their release) and the directory of chains.

Making room is one step, never a loop: `make_room` either holds the room (ready) or takes victims out of the index
and hands them to the caller, still readable here (`_leaving`) until `release`. The store owns the loop (place the
victims below, release, ask again: tiercache.store.tiered), so no tier ever calls the store, and a chunk moving down
is in one tier or the other at every moment (tests/tiers/test_contract.py, "readable while moving down").

A tier supplies the room itself, as hooks called under `_lock`: `_claim` (hold the room if it fits now), `_shortfall`
(the index units still missing), `_hold` and `_let_go` (a victim's room kept from reuse until released), `_unclaim`;
and outside the lock `_drop` (an older record under the key) and `_read_entry` (a victim's bytes).
"""

from __future__ import annotations

import threading
from typing import Generic, Sequence, TypeVar

from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import ChainDirectory, Evicted, NeededAbove, Room, Tier, TierUsage
from tiercache.tiers.index import ChunkIndex, Victim, parent_of

E = TypeVar("E")


def _nothing_above(key: ChunkKey) -> bool:
    return False


class IndexedTier(Tier, ChainDirectory, Generic[E]):
    """The Tier and ChainDirectory methods a tier with a ChunkIndex answers from it (see the module docstring)."""

    def __init__(self, index: ChunkIndex[E], capacity_bytes: int, state_budget_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.state_budget_bytes = state_budget_bytes
        self._index = index
        self._leaving: dict[ChunkKey, E] = {}  # victims handed to the store: still readable until released
        self._lock = threading.Lock()

    # -- making room ------------------------------------------------------------------------------------------------

    def make_room(self, key: ChunkKey, meta: ChunkMeta, size_bytes: int, *, read_victims: bool,
                  needed_above: NeededAbove | None = None) -> Room:
        room = Room(key, meta, size_bytes)
        if size_bytes > self.capacity_bytes or room.state_bytes > self.state_budget_bytes:
            room.reason = f"{size_bytes} bytes exceed what the {self.name} tier may hold"
            return room
        self._drop(key)  # an older record under the key: neither a victim to move down nor room to count
        with self._lock:
            while not (victims := self._take_victims(room, needed_above or _nothing_above)):
                if room.ready:
                    return room
                if not self._wait_for_room():  # everything left is being read, or the record would orphan it
                    room.reason = f"the {self.name} tier has no room for {size_bytes} bytes right now"
                    return room
            for victim in victims:
                self._hold(victim.entry)
                self._leaving[victim.key] = victim.entry
        room.victims = victims
        try:
            room.evicted = self._evicted(victims, read_victims)
        except BaseException:
            self.release(room)
            raise
        return room

    def _take_victims(self, room: Room, needed_above: NeededAbove) -> list[Victim[E]]:
        """Under the lock: hold the room if it fits now (no victims), else take out of the index what goes first
        until it would."""
        room.claim = self._claim(room.size, room.state_bytes)
        if room.ready:
            return []
        return self._index.victims(self._shortfall(room.size),
                                   self._index.state_excess(room.state_bytes, self.state_budget_bytes),
                                   units=self._units, evictable=self._evictable, keep=parent_of(room.key, room.meta),
                                   needed_above=needed_above)

    def _evicted(self, victims: list[Victim[E]], read: bool) -> list[Evicted]:
        """Outside the lock: the victims as evicted records, read when `read` (unreachable ones are not: nothing below
        wants them). One whose bytes are gone already (a file removed under us) is left out: nothing to move down."""
        evicted = []
        for victim in victims:
            record = self._read_entry(victim.entry) if read and victim.reachable else None
            if record is not None or not read or not victim.reachable:
                evicted.append(Evicted(victim.key, record, victim.reachable))
        return evicted

    def release(self, room: Room) -> None:
        with self._lock:
            for victim in room.victims:
                if self._leaving.get(victim.key) is victim.entry:
                    del self._leaving[victim.key]
                self._let_go(victim.entry)
            room.victims, room.evicted = [], []
            if room.claim is not None:
                self._unclaim(room.claim, room.size, room.state_bytes)
                room.claim = None

    # -- reading ----------------------------------------------------------------------------------------------------

    def _found(self, key: ChunkKey) -> E | None:
        """Under the lock: a record held here for a reader, in the index (marked used) or on its way down."""
        entry = self._index.touch(key)
        return entry if entry is not None else self._leaving.get(key)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._index or k in self._leaving for k in keys]

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

    # -- the directory of chains ------------------------------------------------------------------------------------

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, ChunkMeta]]:
        with self._lock:
            return [(key, entry.meta) for key, entry in self._index.children(parent)]

    def orphan(self, parent: ChunkKey) -> int:
        with self._lock:
            return self._index.orphan(parent)

    def entries(self, namespaces: frozenset[str]) -> list[tuple[ChunkKey, ChunkMeta]]:
        with self._lock:
            return [(key, entry.meta) for key, entry in self._index.items() if key.namespace in namespaces]

    # -- hooks: the room itself, per tier ---------------------------------------------------------------------------

    def _claim(self, size: int, state: int) -> object | None:
        """Under the lock: hold room for `size` bytes (`state` of them against the state budget) if it is free now."""
        raise NotImplementedError

    def _shortfall(self, size: int) -> int:
        """Under the lock: the index units (`_units`) to free before `size` bytes fit."""
        raise NotImplementedError

    @staticmethod
    def _units(entry: E) -> int:
        return entry.record_bytes

    @staticmethod
    def _evictable(entry: E) -> bool:
        return True

    def _hold(self, entry: E) -> None:
        """Under the lock: keep a victim's room from reuse while it leaves."""

    def _let_go(self, entry: E) -> None:
        """Under the lock: the victim has left; its room may be reused."""
        raise NotImplementedError

    def _unclaim(self, claim: object, size: int, state: int) -> None:
        """Under the lock: give back a claim that was not written."""
        raise NotImplementedError

    def _wait_for_room(self) -> bool:
        """Under the lock: wait a while for room already on its way out; False when none is."""
        return False

    def _drop(self, key: ChunkKey) -> None:
        """An older record under `key`, removed before its room is counted."""
        raise NotImplementedError

    def _read_entry(self, entry: E) -> bytes | bytearray | None:
        """Outside the lock (the entry is held): its record, or None when it is gone."""
        raise NotImplementedError
