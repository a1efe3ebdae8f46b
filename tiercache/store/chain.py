"""The store as the Lookup search sees it (tiercache.prefix.lookup.ChainView), over one namespace or every
tensor-parallel rank's: an object counts only when each rank holds its shard, and it is in the slowest of their tiers
(a load waits for its last shard); the directory is the first rank's.

The one view for every caller that must agree with Lookup: the Lookup RPC, the pod query (tiercache.events.query)
and the restorable index behind the KV events (tiercache.events.restorable), which asks with a memo (one recompute
asks about the same keys many times) and a record of what it saw held. Asking moves no bytes and changes no recency
(TieredStore.locate and children).
"""

from __future__ import annotations

from typing import Sequence

from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore


class StoreChain:
    """`memo`: keep every answer (presence, children) for the life of this view. `seen`: written with every key
    asked (in each rank namespace) and whether it was held."""

    def __init__(self, store: TieredStore, namespaces: Sequence[str], *, memo: bool = False,
                 seen: dict[ChunkKey, bool] | None = None) -> None:
        self.store = store
        self.namespaces = list(namespaces)
        self._levels = {tier.name: level for level, tier in enumerate(store.tiers)}
        self._seen = seen
        self._tiers: dict[bytes, str | None] | None = {} if memo else None
        self._children: dict[bytes, list[tuple[bytes, ChunkMeta]]] | None = {} if memo else None
        self._metas: dict[bytes, ChunkMeta] = {}

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier each object is in (the slowest of its ranks'), or None when a rank lacks it."""
        if self._tiers is None:
            return self._locate(keys)
        missing = [k for k in dict.fromkeys(keys) if k not in self._tiers]
        if missing:
            self._tiers.update(zip(missing, self._locate(missing)))
        return [self._tiers[k] for k in keys]

    def tier(self, key: bytes) -> str | None:
        return self.locate([key])[0]

    def children(self, parent: bytes) -> list[tuple[bytes, ChunkMeta]]:
        """The objects the first rank holds whose parent is `parent`; with a memo, sorted by key (the restorable
        index walks children in that order)."""
        if self._children is None:
            return [(key.key, meta) for key, meta in self.store.children(ChunkKey(self.namespaces[0], parent))]
        found = self._children.get(parent)
        if found is None:
            found = self._children[parent] = sorted(
                (key.key, meta) for key, meta in self.store.children(ChunkKey(self.namespaces[0], parent)))
            self._metas.update(found)
        return found

    def meta_of(self, key: bytes) -> ChunkMeta | None:
        """With a memo: the meta of an object listed by an earlier `children` call."""
        return self._metas.get(key)

    def _locate(self, keys: Sequence[bytes]) -> list[str | None]:
        where: list[str | None] = []
        for rank, namespace in enumerate(self.namespaces):
            asked = [ChunkKey(namespace, k) for k in keys]
            found = self.store.locate(asked)
            if self._seen is not None:
                self._seen.update((key, tier is not None) for key, tier in zip(asked, found))
            where = found if rank == 0 else [None if a is None or b is None else max(a, b, key=self._levels.get)
                                             for a, b in zip(where, found)]
        return where
