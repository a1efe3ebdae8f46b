"""TieredStore: the policy above the tiers. Placement, demotion on eviction, promotion on hit, write-through.

Tiers are ordered fastest first (gpu -> host -> disk -> redis; gpu only with --gpu-mem). A put lands in the first
tier that can take it; what that tier evicts is demoted to the next one (write-back), and so on down; what falls off
the last tier is gone. A hit below the top is promoted to the top. Local tiers are exclusive (a promoted chunk leaves
the disk); a tier shared by nodes (Redis) is inclusive (other servers still read it there). With write-through, every
put is also copied to that tier at once, so other nodes see new chunks without waiting for eviction.

The store holds no lock around tier calls; tiers lock their own metadata, and the counters their own (stats.py).

Watchers (`watch`) hear of every change of where a key is held: placed, moved to another tier (demoted, promoted),
lost (evicted from the last tier, deleted, found corrupt). The KV events that routers read (tiercache.events) are
derived from them; a watcher only takes note, and asks the store itself where things are when it gets to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tiercache.config import Config
from tiercache.errors import CapacityExceeded, ChunkCorrupt, TierDown, TierWriteFailed, Unavailable
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.store.lineage import Lineage
from tiercache.store.reports import EngineReports
from tiercache.store.stats import StoreStats, TierCounts, namespace_usage
from tiercache.tiers import from_config as tiers_from_config
from tiercache.tiers.base import Evicted, Room, Tier

# A watcher's argument: the keys whose place changed, each with its meta when it is held (placed, moved), None when
# the store lost it (or dropped a corrupt copy, which may leave another below). Called on the thread of the change,
# outside every tier's lock: it must only take note.
Watcher = Callable[[list[tuple[ChunkKey, "encoding.ChunkMeta | None"]]], None]


@dataclass(frozen=True)
class StoredChunk:
    """A chunk's payload as the store read it, and the tier it was read from."""

    payload: memoryview
    tier: str


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], *, write_through: bool = False) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tuple(tiers)
        self.write_through = write_through
        self._counts = TierCounts([t.name for t in self.tiers])
        self.reports = EngineReports()  # what connectors' lookups found and what their engines loaded
        self._watchers: list[Watcher] = []
        self._lineage = Lineage(self.tiers, lambda tier: self._count(tier, errors=1))

    @classmethod
    def from_config(cls, config: Config, cancelled: Callable[[], bool] | None = None) -> "TieredStore":
        """The store over the tiers `config` enables; `cancelled()` true stops their preparation (StartCancelled)."""
        tiers = tiers_from_config(config, cancelled)
        if not tiers:
            raise CapacityExceeded("every tier is disabled: give the host, disk or redis tier some capacity")
        return cls(tiers, write_through=config.redis.write_through)

    def watch(self, watcher: Watcher) -> None:
        """Tell `watcher` of every change of where a key is held from now on (see the module docstring)."""
        self._watchers.append(watcher)

    def entries(self, namespaces: frozenset[str]) -> list[tuple[ChunkKey, encoding.ChunkMeta]]:
        """Every key (and meta) the tiers with a directory hold in `namespaces`, once each (Redis is not listed: it
        cannot say what it holds, and other nodes write it)."""
        found: dict[ChunkKey, encoding.ChunkMeta] = {}
        for tier in self._lineage.directories:
            try:
                for key, meta in tier.entries(namespaces):
                    found.setdefault(key, meta)
            except TierDown:
                self._count(tier, errors=1)
        return list(found.items())

    def _changed(self, changes: list[tuple[ChunkKey, encoding.ChunkMeta | None]]) -> None:
        for watcher in self._watchers:
            watcher(changes)

    # -- the store's operations ------------------------------------------------------------------------------------

    def put(self, key: ChunkKey, payload, meta: encoding.ChunkMeta = encoding.ChunkMeta()) -> str:
        """Store a copy of `payload`; returns the name of the tier that holds it."""
        return self.put_record(key, encoding.encode(key, payload, meta))

    def put_record(self, key: ChunkKey, record: bytearray) -> str:
        """Store an already sealed record (the server assembles records in place to save a copy)."""
        placed = self._place(key, record, 0)
        self.after_placement(key, encoding.read_meta(record), placed, lambda: record)
        return self.tiers[placed].name

    def count_hit(self, tier: Tier) -> None:
        """For the same-host path (tiercache.store.same_host), which pins in the arena tier itself."""
        self._count(tier, hits=1)

    def after_placement(self, key: ChunkKey, meta: encoding.ChunkMeta, placed: int, record) -> None:
        """Drop older copies below the tier a record landed in, and copy it to a tier shared by nodes (write-through).
        Every put ends here, the same-host path's commits too; a record whose parent the store lost before it arrived
        is an orphan from the start (tiercache.store.lineage)."""
        if self._watchers:
            self._changed([(key, meta)])
        self._lineage.placed(key, meta, self.tiers[placed])
        for tier in self.tiers[placed + 1:]:  # an older copy further down would shadow nothing but waste room
            if not tier.shared_by_nodes and tier.contains([key])[0]:
                tier.delete([key])
        if self.write_through:
            for level in range(placed + 1, len(self.tiers)):
                if self.tiers[level].shared_by_nodes:
                    self._copy_to(level, key, record())

    def get(self, key: ChunkKey) -> StoredChunk | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[StoredChunk | None]:
        """Each key's payload from the highest tier holding it (promoted to the top on the way), or None: one
        get_many per tier for the keys still missing (one round trip to Redis for a batch)."""
        found: list[StoredChunk | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            records = self._read(tier, [keys[i] for i in pending])
            missing = []
            for i, record in zip(pending, records):
                if record is None:
                    missing.append(i)
                    continue
                try:
                    payload = encoding.decode(record, keys[i], verify=tier.checksum_on_read)
                except ChunkCorrupt:
                    self._count(tier, checksum_failures=1, misses=1)
                    self._forget(tier, keys[i])
                    missing.append(i)
                    continue
                self._count(tier, hits=1)
                if level:
                    self._promote(keys[i], record, level)
                found[i] = StoredChunk(payload, tier.name)
            pending = missing
        return found

    def locate(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """For each key, the name of the highest tier holding it, or None. No bytes move, recency is unchanged."""
        where: list[str | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            try:
                present = tier.contains([keys[i] for i in pending])
            except TierDown:
                self._count(tier, errors=1)
                continue
            for i, hit in zip(pending, present):
                if hit:
                    where[i] = tier.name
            pending = [i for i, hit in zip(pending, present) if not hit]
        return where

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark keys most recently used wherever they are held (a hit about to be loaded), moving no bytes."""
        for tier in self.tiers:
            try:
                tier.touch(keys)
            except TierDown:
                self._count(tier, errors=1)

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, encoding.ChunkMeta]]:
        """The chunks any tier holds whose parent is `parent` (tiercache.prefix.lookup's directory)."""
        found: dict[ChunkKey, encoding.ChunkMeta] = {}
        for tier in self._lineage.directories:
            try:
                found.update(tier.children(parent))
            except TierDown:
                self._count(tier, errors=1)
        return list(found.items())

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier; returns how many were removed from the highest tier holding each."""
        removed = [False] * len(keys)
        for tier in self.tiers:
            try:
                present = tier.contains(keys)
                tier.delete([k for k, p in zip(keys, present) if p])
            except TierDown:
                self._count(tier, errors=1)
                continue
            removed = [r or p for r, p in zip(removed, present)]
        self._lost([k for k, r in zip(keys, removed) if r])
        return sum(removed)

    def stats(self) -> StoreStats:
        usages = [(tier, tier.usage()) for tier in self.tiers]
        # A tier shared by nodes holds other servers' chunks too: it has no per-namespace view.
        namespaces = namespace_usage([usage for tier, usage in usages if not tier.shared_by_nodes])
        return StoreStats(self._counts.stats([(tier.name, usage) for tier, usage in usages]), namespaces,
                          self.reports.lookups(), self.reports.delivered())

    def held_bytes(self, owns: Callable[[str], bool]) -> int:
        """Bytes this server's local tiers hold for the namespaces `owns` accepts (a tenant's quota counts these)."""
        return sum(n for tier in self.tiers if not tier.shared_by_nodes
                   for ns, n in tier.usage().bytes_by_namespace.items() if owns(ns))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # -- placement --------------------------------------------------------------------------------------------------

    def _place(self, key: ChunkKey, record, first: int, last: int | None = None) -> int:
        """Put the record in the first tier of tiers[first:last] that takes it (_put_at); returns the level it landed
        on. Raises CapacityExceeded when no tier can hold it, Unavailable when the only tiers that could are down."""
        last = len(self.tiers) if last is None else last
        meta = encoding.read_meta(record)  # a tier's codec changes the payload's bytes, never the meta
        down, write_failure = False, ""
        for level in range(first, last):
            tier = self.tiers[level]
            if self.write_through and tier.shared_by_nodes and first > 0:
                return level  # demoting into the tier shared by nodes: write-through put it there already
            try:
                if not self._put_at(level, key, record, meta):
                    continue
            except TierWriteFailed as failed:
                self._count(tier, errors=1)
                write_failure = f" ({failed})"
                continue
            except TierDown:
                self._count(tier, errors=1)
                down = True
                continue
            return level
        if down:
            raise Unavailable(f"no tier could store {len(record)} bytes: the tier that could is down")
        raise CapacityExceeded(f"{len(record)} bytes are more than any tier can hold{write_failure}")

    def make_room(self, level: int, key: ChunkKey, meta: encoding.ChunkMeta, size: int) -> Room | None:
        """Room for a record of `size` bytes in tier `level`, or None when it cannot make it now (the record is too
        large for it, or everything it could evict is being read). The store's one eviction loop: each round the
        tier takes victims out of its index, still readable there; they are placed in the tiers below, and only
        then does the tier reuse their room (so a chunk moving down is in some tier at every moment)."""
        tier = self.tiers[level]
        read = level + 1 < len(self.tiers)  # the last tier's victims fall off: no need for their bytes
        while True:
            room = tier.make_room(key, meta, size, read_victims=read, needed_above=self._lineage.needed_above[level])
            if room.ready:
                return room
            if not room.victims:
                return None
            try:
                self.demote(room.evicted, level)
            finally:
                tier.release(room)

    def demote(self, evicted: list[Evicted], level: int) -> None:
        """Move what tier `level` evicted to the tiers below it."""
        if not evicted:
            return
        self._count(self.tiers[level], evictions=len(evicted))
        lost = []
        for item in evicted:
            if item.record is None or level + 1 >= len(self.tiers):  # the last tier's, or unreachable
                lost.append(item.key)
                continue
            try:
                landed = self._place(item.key, item.record, level + 1)
            except (CapacityExceeded, Unavailable):
                lost.append(item.key)  # fell off the bottom: an eviction, already counted
                continue
            except ChunkCorrupt:  # found bad while transcoding for the tier below: never passed on
                self._count(self.tiers[level], checksum_failures=1)
                lost.append(item.key)
                continue
            self._count(self.tiers[landed], demotions=1)
            if self._watchers:
                self._changed([(item.key, encoding.read_meta(item.record))])
        self._lost(lost)

    def _lost(self, keys: Sequence[ChunkKey]) -> None:
        """Keys no tier holds any more: whatever descends from them in a chain is unreachable now (evicted first)."""
        if keys and self._watchers:
            self._changed([(key, None) for key in keys])
        self._lineage.lost(keys)

    def _promote(self, key: ChunkKey, record, level: int) -> None:
        source = self.tiers[level]
        try:
            self._place(key, record, 0, level)
        except (CapacityExceeded, Unavailable):
            return  # stays where it is
        self._count(source, promotions=1)
        if not source.shared_by_nodes:
            self._forget(source, key)
        if self._watchers:
            self._changed([(key, encoding.read_meta(record))])

    def _for_tier(self, tier: Tier, key: ChunkKey, record):
        """The record as `tier` stores it: sealed before it leaves memory for a verifying tier, in its codec."""
        if tier.checksum_on_read:
            record = encoding.sealed(record, key)
        return encoding.transcode(record, key, tier.codec)

    def _put_at(self, level: int, key: ChunkKey, record, meta: encoding.ChunkMeta) -> bool:
        """The store's one way into a tier: the record in tier `level`'s form, room made there, put. False when the
        tier cannot make room now; its failures (TierDown, TierWriteFailed, ChunkCorrupt) are the caller's."""
        tier = self.tiers[level]
        stored = self._for_tier(tier, key, record)
        room = self.make_room(level, key, meta, len(stored))
        if room is None:
            return False
        tier.put(room, stored)
        return True

    def _copy_to(self, level: int, key: ChunkKey, record) -> None:
        """Write-through: a copy in the tier shared by nodes, a failure counted and nothing else."""
        tier = self.tiers[level]
        try:
            if not self._put_at(level, key, record, encoding.read_meta(record)):
                self._count(tier, errors=1)
        except (TierDown, TierWriteFailed, ChunkCorrupt):
            self._count(tier, errors=1)

    # -- small helpers ----------------------------------------------------------------------------------------------

    def _read(self, tier: Tier, keys: Sequence[ChunkKey]) -> list:
        """tier.get_many(keys), misses counted; a tier that is down misses them all."""
        try:
            records = tier.get_many(keys)
        except TierDown:
            self._count(tier, errors=1, misses=len(keys))
            return [None] * len(keys)
        misses = sum(record is None for record in records)
        if misses:
            self._count(tier, misses=misses)
        return records

    def _forget(self, tier: Tier, key: ChunkKey) -> None:
        try:
            tier.delete([key])
        except TierDown:
            self._count(tier, errors=1)
        if self._watchers:
            self._changed([(key, None)])

    def _count(self, tier: Tier, **increments: int) -> None:
        self._counts.add(tier.name, **increments)

