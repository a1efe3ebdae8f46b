"""The store's chain bookkeeping: which keys it lost for good, and what of a chain that leaves unreachable.

A chunk names its parent (ChunkMeta.parent) and a lookup walks a chain from its head (tiercache.prefix.lookup), so a
chunk whose ancestor is gone can never be found again. The tiers with a directory of chains mark such a chunk an
orphan and evict it first (tiers/index.py). Orphans appear two ways:
- a key lost for good (evicted from the last tier, deleted, found corrupt): its descendants, at once (`lost`);
- a record placed after its parent was lost (a save racing the eviction of the chain it extends): it, as it lands
  (`placed`), or it would keep its room, a chain's deep end outliving its head.
And a tier making room asks whether a tier above holds a child of a candidate (`needed_above`): a parent held below
its children is no leaf. tests/store/test_chains.py holds all three.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable, Sequence

from tiercache.errors import TierDown
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import ChainDirectory, Tier

LOST_KEYS_REMEMBERED = 1 << 16  # keys lost for good remembered, for records that arrive after their parent left


class Lineage:
    """`tier_failed(tier)`: how a tier found down is counted (the store's error counter)."""

    def __init__(self, tiers: Sequence[Tier], tier_failed: Callable[[Tier], None]) -> None:
        self._tier_failed = tier_failed
        self._lock = threading.Lock()
        self._gone: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()  # lost, not stored again
        # The tiers with a directory of chains: the others (Redis) hold no children, orphan nothing.
        self.directories = [tier for tier in tiers if isinstance(tier, ChainDirectory)]
        # Per level, how its tier asks whether a local tier above holds a child of a key; passed to each make_room, so
        # nothing of the store is planted in a tier.
        self.needed_above: list[Callable[[ChunkKey], bool] | None] = []
        for level, tier in enumerate(tiers):
            above = [t for t in tiers[:level] if isinstance(t, ChainDirectory) and not t.shared_by_nodes]
            self.needed_above.append(functools.partial(self._has_children, above)
                                     if above and isinstance(tier, ChainDirectory) else None)

    def placed(self, key: ChunkKey, meta: encoding.ChunkMeta, tier: Tier) -> None:
        """A record landed in `tier`: it is no longer lost, and it is an orphan there if its parent is."""
        parent = ChunkKey(key.namespace, meta.parent) if meta.parent else None
        with self._lock:
            self._gone.pop(key, None)
            parent_gone = parent in self._gone
        if parent_gone and isinstance(tier, ChainDirectory):
            try:
                tier.orphan(parent)
            except TierDown:
                self._tier_failed(tier)

    def lost(self, keys: Sequence[ChunkKey]) -> None:
        """Keys no tier holds any more: whatever descends from them in a local tier is an orphan now."""
        with self._lock:
            for key in keys:
                self._gone[key] = None
                self._gone.move_to_end(key)
            while len(self._gone) > LOST_KEYS_REMEMBERED:
                self._gone.popitem(last=False)
        for tier in self.directories:
            if tier.shared_by_nodes:
                continue
            for key in keys:
                try:
                    tier.orphan(key)
                except TierDown:
                    self._tier_failed(tier)

    def _has_children(self, tiers: Sequence[ChainDirectory], key: ChunkKey) -> bool:
        """Whether any of `tiers` holds an object whose parent is `key`."""
        for tier in tiers:
            try:
                if tier.children(key):
                    return True
            except TierDown:
                self._tier_failed(tier)
        return False
