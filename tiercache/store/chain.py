"""The store as the Lookup search sees it (tiercache.prefix.lookup.ChainView), over one namespace or every
tensor-parallel rank's: an object counts only when each rank holds its shard; the directory is the first rank's.

One view for every caller of the search that must agree with Lookup (the Lookup RPC, the pod query of
tiercache.events.query). Asking it moves no bytes and changes no recency (TieredStore.locate and children)."""

from __future__ import annotations

from typing import Sequence

from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore


class StoreChain:
    def __init__(self, store: TieredStore, namespaces: Sequence[str]) -> None:
        self.store = store
        self.namespaces = list(namespaces)

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        where = self.store.locate([ChunkKey(self.namespaces[0], k) for k in keys])
        for namespace in self.namespaces[1:]:
            other = self.store.locate([ChunkKey(namespace, k) for k in keys])
            where = [tier if also else None for tier, also in zip(where, other)]
        return where

    def children(self, parent: bytes) -> list[tuple[bytes, ChunkMeta]]:
        return [(key.key, meta) for key, meta in self.store.children(ChunkKey(self.namespaces[0], parent))]
