"""What the prefix tests share: tiny layouts, and FakeCache, a dict of keys standing in for the server's store (a
prefix.lookup.ChainView) with the same search, the same two-call protocol as PrefixCache.lookup and admission."""


from __future__ import annotations


import numpy as np

from tiercache.prefix.admission import plan_finish_admission, plan_prompt_admission
from tiercache.prefix.hashes import InsideChunk
from tiercache.prefix.hit import Hit, Located, required_objects
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor
from tiercache.prefix.lookup import Query, find_hit
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_meta

N, U = 32, 8
STATE = (StateTensor("ssm", (2, 4, 4), "float32"),)


def layout(*groups) -> ModelLayout:
    return ModelLayout("tiny", tuple(groups))


HYBRID = layout(LayerGroup(GroupKind.FULL_ATTENTION, (0,), kv_heads=1, head_dim=4),
                LayerGroup(GroupKind.RECURRENT, (1, 2), state=STATE))
ATTENTION = layout(LayerGroup(GroupKind.FULL_ATTENTION, (0, 1), kv_heads=1, head_dim=4))
SLIDING = layout(LayerGroup(GroupKind.SLIDING_WINDOW, (0,), kv_heads=1, head_dim=4, window=20),
                 LayerGroup(GroupKind.FULL_ATTENTION, (1,), kv_heads=1, head_dim=4),
                 LayerGroup(GroupKind.SLIDING_WINDOW, (2,), kv_heads=1, head_dim=4, window=40))


class FakeCache:
    """A dict of keys standing in for the server's store: the same search (find_hit) over it, with the directory
    of children by parent, and the same two-call protocol as PrefixCache.lookup."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.keys: dict[bytes, object] = {}
        self.calls = 0

    # the ChainView protocol
    def locate(self, keys):
        return ["host" if k in self.keys else None for k in keys]

    def children(self, parent):
        return [(ref.key, object_meta(ref)) for ref in self.keys.values() if ref.parent == parent]

    def lookup(self, tokens):
        hashes = self.spec.hashes(tokens)
        positions: dict[int, bytes] = {}
        found = self._find(hashes, positions)
        if found.unverified:
            positions.update((p, hashes.at(p)) for p in found.unverified)
            found = self._find(hashes, positions)
            assert not found.unverified
        refs = required_objects(self.spec, hashes, found.tokens) if found.tokens else []
        assert len(refs) == len(found.tiers)
        hit = Hit(found.tokens, hashes.length, tuple(Located(r, t) for r, t in zip(refs, found.tiers)))
        return hashes, hit, {r.key: "host" for r in refs}

    def _find(self, hashes, positions):
        self.calls += 1
        n = self.spec.chunk_tokens
        last = max(hashes.length - 1, 0)
        deepest = last // n
        boundaries = [hashes.at(k * n) for k in range(deepest + 1)]
        last_chunk = InsideChunk(boundaries[-1], hashes.chunk_tokens_bytes(deepest, last), self.spec.match_unit)
        return find_hit(Query(self.spec.shape, hashes.length, boundaries, positions, last_chunk), self)

    def prefill(self, tokens) -> int:
        """Look up, then save what admission plans, as an engine would; returns the hit."""
        hashes, hit, present = self.lookup(tokens)
        for ref in plan_prompt_admission(self.spec, hashes, hit.tokens, present).objects:
            self.keys[ref.key] = ref
        return hit.tokens

    def finish(self, tokens, prompt_tokens: int) -> None:
        for ref in plan_finish_admission(self.spec, self.spec.hashes(tokens), prompt_tokens).objects:
            self.keys[ref.key] = ref

    def drop(self, kind: ObjectKind, position: int) -> None:
        for key, ref in list(self.keys.items()):
            if ref.kind is kind and ref.position == position:
                del self.keys[key]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)
