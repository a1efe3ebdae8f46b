"""A record into one tier the way the store places it (tiercache.store.tiered.TieredStore.make_room), for tests that
drive a tier alone: the victims are collected and dropped instead of moved down."""

from __future__ import annotations

from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import Evicted, Tier


class NoRoom(AssertionError):
    """The tier refused the room (its Room's reason)."""


def put(tier: Tier, key: ChunkKey, record, *, read_victims: bool = False) -> list[Evicted]:
    """Make room for `record` in `tier` and write it there; returns what the tier evicted for it, in order (with the
    victims' bytes when `read_victims`). Raises NoRoom when the tier cannot make the room."""
    meta = encoding.read_meta(record)
    evicted: list[Evicted] = []
    while True:
        room = tier.make_room(key, meta, len(record), read_victims=read_victims)
        if room.ready:
            tier.put(room, record)
            return evicted
        if not room.victims:
            raise NoRoom(room.reason)
        evicted += room.evicted
        tier.release(room)
