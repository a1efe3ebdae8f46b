"""The search behind the Lookup call: the deepest position a prompt can resume at, over the objects a store holds.

The client sends what it can hash cheaply — the chain hashes at every chunk boundary h(0), h(N), ..., h(KN) with
K = (L-1)//N (~0.3 ms for 262,144 tokens) — the tokens of the last chunk (at most N: the server hashes any position
there itself), and its layout's shape (tiercache.prefix.objects.ChainShape). The server
1. walks the kv chains: one presence check of K keys per attention group, giving how far each chain reaches;
2. goes down the chain from the deepest chunk it can resume in, and in each chunk asks the store's *directory* — the
   tails and states saved under that chunk's kv object (their parent) — which positions hold checkpoints; the
   boundary itself is a candidate too;
3. checks each candidate, deepest first, against the hit rule: the tails and the state of the prompt's own hash at
   that position must be present (a checkpoint of another prompt that shares the chunk has another hash).
A candidate before the last chunk that the client sent no hash for (an earlier turn's end, more than N back) cannot
be checked:
the answer names it `unverified` along with the best hit found without it, and the client asks again with its hash.
So any saved checkpoint is reachable in at most two round trips, whatever the prompt's length, and the hit rule runs
where the presence is, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

from tiercache.errors import InvalidArgument
from tiercache.prefix.hashes import HASH_BYTES, InsideChunk, PrefixHashes
from tiercache.prefix.hit import HitObject, checkpoint_objects, tokens_by_tier
from tiercache.prefix.layout import GroupKind
from tiercache.prefix.objects import ChainShape, ObjectKey, ObjectKind, object_key
from tiercache.record.encoding import ChunkMeta

MAX_GROUPS = 255  # a group is one byte of an object's key


class ChainView(Protocol):
    """What the search needs of a store, in one namespace (or all of a tensor-parallel engine's)."""

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier holding each key, or None."""
        ...

    def children(self, parent: bytes) -> Iterable[tuple[bytes, ChunkMeta]]:
        """The objects stored with `parent` as their parent (key and meta)."""
        ...


@dataclass(frozen=True)
class Query:
    """One prompt's lookup: its shape, its length, and the chain hashes the client computed."""

    shape: ChainShape
    prompt_tokens: int
    boundaries: Sequence[bytes]  # h(kN) for k = 0 .. (L-1)//N
    positions: Mapping[int, bytes]  # h(p) at other positions (p not a multiple of N)
    last_chunk: InsideChunk | None = None  # hashes any position of the last chunk, up to L-1

    def __post_init__(self) -> None:
        n = self.shape.chunk_tokens
        if n <= 0:
            raise InvalidArgument("chunk_tokens must be positive")
        if not 1 <= len(self.shape.kinds) <= MAX_GROUPS:
            raise InvalidArgument(f"a lookup names 1..{MAX_GROUPS} layer groups, got {len(self.shape.kinds)}")
        for kind, window in zip(self.shape.kinds, self.shape.windows):
            if (kind is GroupKind.SLIDING_WINDOW) != (window is not None) or (window is not None and window <= 0):
                raise InvalidArgument("a positive window is given exactly for sliding-window groups")
        expected = max(self.prompt_tokens - 1, 0) // n + 1
        if len(self.boundaries) != expected:
            raise InvalidArgument(f"a prompt of {self.prompt_tokens} tokens needs {expected} boundary hashes, "
                                  f"got {len(self.boundaries)}")
        hashes = list(self.boundaries) + list(self.positions.values())
        if any(len(h) != HASH_BYTES for h in hashes):
            raise InvalidArgument(f"chain hashes are {HASH_BYTES} bytes")
        if any(not 1 <= p < self.prompt_tokens or p % n == 0 for p in self.positions):
            raise InvalidArgument("positions lie inside the prompt, between chunk boundaries")

    def at(self, p: int) -> bytes:
        """h(p); KeyError when the client sent neither it nor the tokens to compute it."""
        n = self.shape.chunk_tokens
        if p % n == 0:
            return self.boundaries[p // n]
        deepest = (len(self.boundaries) - 1) * n
        if self.last_chunk is not None and p > deepest:
            return self.last_chunk.at(p - deepest)
        return self.positions[p]


@dataclass(frozen=True)
class LookupHit:
    """The search's answer: resume at `tokens`, loading the objects prefix.hit.required_objects names for it, described
    in that order as (kind, group, tokens of KV held, tier)."""

    tokens: int
    objects: tuple[HitObject, ...] = ()
    chain_chunks: int = 0  # kv chunks every attention group holds from the prompt's start
    unverified: tuple[int, ...] = ()  # checkpoint positions deeper than the hit whose hash the query lacked
    checkpoints: tuple[bytes, ...] = ()  # keys of the hit's tails and state (the leaves a load must not evict)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(tier for *_, tier in self.objects)

    def tokens_by_tier(self) -> dict[str, int]:
        return tokens_by_tier(self.tokens, self.objects)


def find_hit(query: Query, view: ChainView) -> LookupHit:
    shape = query.shape
    n = shape.chunk_tokens
    last = query.prompt_tokens - 1
    if last < 1:
        return LookupHit(0)
    chains = _KvChains(query, view)
    unverified: list[int] = []
    for k in range(chains.top, -1, -1):
        for p in _candidates(query, view, k):
            if not chains.complete_for(p):
                continue
            if p % n == 0 and not shape.recurrent:
                return LookupHit(p, chains.objects_at(p, {}), chains.reach, tuple(unverified))
            try:
                refs = checkpoint_objects(shape, query, p)
            except KeyError:
                unverified.append(p)
                continue
            where = view.locate([r.key for r in refs])
            if all(where):
                checkpoints = {r.group: tier for r, tier in zip(refs, where)}
                return LookupHit(p, chains.objects_at(p, checkpoints), chains.reach, tuple(unverified),
                             tuple(r.key for r in refs))
    return LookupHit(0, (), chains.reach, tuple(unverified))


def prompt_query(shape: ChainShape, hashes: PrefixHashes, positions: Mapping[int, bytes] | None = None) -> Query:
    """The query a connector sends for a whole prompt (connector.prefix_cache.PrefixCache.lookup), built where its
    tokens are: h(0) .. h(KN) with K = (L-1)//N, the tokens of [KN, L-1), and the positions asked for. (L >= 1.)"""
    deepest = (hashes.length - 1) // shape.chunk_tokens
    data = hashes.boundaries(deepest)
    boundaries = [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]
    last_chunk = InsideChunk(boundaries[-1], hashes.chunk_tokens_bytes(deepest, hashes.length - 1), hashes.u)
    return Query(shape, hashes.length, boundaries, dict(positions or {}), last_chunk)


def find_prompt_hit(shape: ChainShape, hashes: PrefixHashes, view: ChainView) -> LookupHit:
    """The search for a prompt whose tokens are at hand (a router's query on the server): the positions the first
    pass names `unverified` are hashed and asked at once, as the client's second Lookup call does."""
    if hashes.length < 2:
        return LookupHit(0)
    hit = find_hit(prompt_query(shape, hashes), view)
    if hit.unverified:
        hit = find_hit(prompt_query(shape, hashes, {p: hashes.at(p) for p in hit.unverified}), view)
    return hit


class _KvChains:
    """Where each attention group's kv chunks of the prompt lie, and how far each reaches without a gap."""

    def __init__(self, query: Query, view: ChainView) -> None:
        shape = query.shape
        deepest = len(query.boundaries) - 1
        self.n = shape.chunk_tokens
        self.shape = shape
        keys = [object_key(query.boundaries[k], ObjectKind.KV, g)
                for g in shape.attention for k in range(1, deepest + 1)]
        where = view.locate(keys) if keys else []
        self._where: dict[int, list[str | None]] = {}  # group -> tier of chunk k at index k - 1
        self._missing_before: dict[int, list[int]] = {}  # group -> prefix counts of missing chunks
        runs = []
        for i, group in enumerate(shape.attention):
            tiers = where[i * deepest:(i + 1) * deepest]
            counts = [0]
            for tier in tiers:
                counts.append(counts[-1] + (tier is None))
            self._where[group] = tiers
            self._missing_before[group] = counts
            runs.append(counts.index(1) - 1 if counts[-1] else deepest)
        self.reach = min(runs, default=0)  # chunks every group holds from the start
        full = [r for g, r in zip(shape.attention, runs) if shape.kinds[g] is GroupKind.FULL_ATTENTION]
        self.top = min(full) if full else deepest  # no full-attention group: gaps may be out of every window

    def complete_for(self, p: int) -> bool:
        """Whether every attention group holds the kv chunks resuming at p needs."""
        for group, counts in self._missing_before.items():
            if counts[p // self.n] - counts[self.shape.first_chunk(group, p) - 1]:
                return False
        return True

    def objects_at(self, p: int, checkpoints: Mapping[int, str]) -> tuple[HitObject, ...]:
        """Each object resuming at p needs, in required_objects order; `checkpoints`: the tier of the tail or state
        of each group at p."""
        n = self.n
        objects: list[HitObject] = []
        for group, kind in enumerate(self.shape.kinds):
            if kind is GroupKind.RECURRENT:
                objects.append(HitObject(ObjectKind.STATE, group, 0, checkpoints[group]))
                continue
            objects += [HitObject(ObjectKind.KV, group, n, tier)
                        for tier in self._where[group][self.shape.first_chunk(group, p) - 1:p // n]]
            if p % n:
                objects.append(HitObject(ObjectKind.TAIL, group, p % n, checkpoints[group]))
        return tuple(objects)


def _candidates(query: Query, view: ChainView, k: int) -> list[int]:
    """Positions in [kN, (k+1)N) that may hold a checkpoint, deepest first: what the directory holds under chunk k's
    anchor kv object, the positions the client sent, and the boundary kN itself."""
    shape = query.shape
    n = shape.chunk_tokens
    low, high = k * n, min((k + 1) * n, query.prompt_tokens)  # high: exclusive; p <= L-1
    found = {low} if k else set()
    parent = object_key(query.boundaries[k], ObjectKind.KV, shape.anchor)
    for key, meta in view.children(parent):
        child = ObjectKey.parse(key)
        if child is None:
            continue
        if child.kind is ObjectKind.STATE:
            found.add(meta.prefix_tokens)
        elif child.kind is ObjectKind.TAIL:
            found.add(low + meta.prefix_tokens)
    found.update(p for p in query.positions if low <= p < high)
    if query.last_chunk is not None and k == len(query.boundaries) - 1:
        found.add(query.prompt_tokens - 1)  # an exact repeat, whether or not its checkpoint names a parent
    return sorted((p for p in found if low <= p < high and p >= 1), reverse=True)
