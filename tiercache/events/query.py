"""The pod query: for a router that reads no events, how many tokens of a prompt each registered pod can restore from
this server, and from which tiers (docs/events.md, "Query API"; tests/events/test_query.py).

A pod's answer is exactly what the server's Lookup answers the pod's own connector for that prompt: the prompt is
hashed as the connector hashes it (the pod's first namespace, N and u: tiercache.prefix.hashes), and the one search
(tiercache.prefix.lookup.find_hit, the hybrid hit rule: every attention group's kv chain, the tail, the deepest
checkpoint) runs over the pod's rank namespaces (tiercache.store.chain.StoreChain, the Lookup RPC's own view). A query
is no use of the cache: nothing is touched, promoted or counted in the lookup statistics (StoreChain reads presence
and the directory only).

By hash: a router that holds the engine's block hashes (the 64-bit values the events publish) gets the token ids of
the blocks they name from the restorable index (RestorableIndex.tokens_of: what the pod advertises), and the same
search runs over them. Block hashes name whole blocks and say nothing of what follows, so the answer is the hit of a
prompt that starts with those blocks and goes on: at most their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from tiercache.errors import InvalidArgument
from tiercache.events.blocks import MEDIUM_BY_TIER, Pod
from tiercache.events.restorable import RestorableIndex
from tiercache.prefix.hashes import PrefixHashes, token_bytes
from tiercache.prefix.hit import HitObject, tokens_by_tier
from tiercache.prefix.lookup import LookupHit, find_prompt_hit
from tiercache.prefix.objects import ObjectKind
from tiercache.store.chain import StoreChain
from tiercache.store.tiered import TieredStore

MAX_QUERY_TOKENS = 1 << 20  # 4 MiB of token ids: longer than any context a router routes today
MAX_QUERY_HASHES = 1 << 16


@dataclass(frozen=True)
class PodHit:
    """One pod's answer: the tokens it can restore (`tokens`, Lookup's hit_tokens) and the hit's objects as the search
    found them (LookupHit.objects: kind, group, tokens of KV, tier)."""

    pod: Pod
    tokens: int
    objects: tuple[HitObject, ...] = ()

    def tokens_by_tier(self, limit: int | None = None) -> dict[str, int]:
        """The hit's tokens by the tier their KV lies in (prefix.hit.tokens_by_tier); with `limit`, of its first
        `limit` tokens only (a router that counts whole blocks of its own size). The first attention group's kv
        chunks and tail come in prompt order (prefix.hit.required_objects), so the cut keeps the first tokens of
        KV; the state covers the rest, as for the whole hit."""
        if limit is None or limit >= self.tokens:
            return tokens_by_tier(self.tokens, self.objects)
        kept, covered, first_group = [], 0, None
        for kind, group, tokens, tier in self.objects:
            if kind is ObjectKind.STATE:
                kept.append(HitObject(kind, group, tokens, tier))
                continue
            first_group = group if first_group is None else first_group
            if group == first_group and covered < limit:
                take = min(tokens, limit - covered)
                kept.append(HitObject(kind, group, take, tier))
                covered += take
        return tokens_by_tier(limit, kept)

    def tokens_by_medium(self, limit: int | None = None) -> dict[str, int]:
        """By vLLM's media (CPU, STORAGE), as the events label the tiers (blocks.MEDIUM_BY_TIER)."""
        by_medium: dict[str, int] = {}
        for tier, tokens in self.tokens_by_tier(limit).items():
            medium = MEDIUM_BY_TIER.get(tier, "STORAGE")
            by_medium[medium] = by_medium.get(medium, 0) + tokens
        return by_medium


def query_tokens(store: TieredStore, pods: Iterable[Pod], token_ids: Sequence[int]) -> list[PodHit]:
    """Each pod's restorable hit for the prompt `token_ids`."""
    if len(token_ids) > MAX_QUERY_TOKENS:
        raise InvalidArgument(f"a query names at most {MAX_QUERY_TOKENS} tokens, got {len(token_ids)}")
    ids = list(token_ids)
    token_bytes(ids)  # checked once: InvalidArgument for anything but uint32 ids
    hashes: dict[tuple[str, int, int], PrefixHashes] = {}  # pods of one model and layout share their hashes,
    hits: dict[tuple, LookupHit] = {}  # and pods of the same namespaces (an engine's data-parallel ranks) their hit
    answers = []
    for pod in pods:
        n, u = pod.shape.chunk_tokens, pod.match_unit
        key = (pod.namespaces[0], n, u)
        if key not in hashes:
            hashes[key] = PrefixHashes(pod.namespaces[0], ids, n, u)
        same = (pod.namespaces, pod.shape, u)
        if same not in hits:
            hits[same] = find_prompt_hit(pod.shape, hashes[key], StoreChain(store, pod.namespaces))
        answers.append(PodHit(pod, hits[same].tokens, hits[same].objects))
    return answers


def query_hashes(store: TieredStore, index: RestorableIndex, pods: Iterable[Pod],
                 block_hashes: Sequence[int]) -> list[PodHit]:
    """Each pod's restorable hit for a prompt that starts with the blocks `block_hashes` name (as the pod's events
    published them), whatever follows."""
    if len(block_hashes) > MAX_QUERY_HASHES:
        raise InvalidArgument(f"a query names at most {MAX_QUERY_HASHES} block hashes, got {len(block_hashes)}")
    if any(not 0 <= h < 1 << 64 for h in block_hashes):
        raise InvalidArgument("block hashes are unsigned 64-bit integers")
    answers = []
    for pod in pods:
        tokens = index.tokens_of(pod.pod_id, block_hashes)
        if not tokens:
            answers.append(PodHit(pod, 0))
            continue
        # One token more than the blocks hold: the hit is at most L-1, and a prompt that goes on past its last block
        # may resume at that block's end. The extra token is never hashed (it completes no chain link; the last
        # chunk's positions are hashed only up to L-1), so its value does not matter.
        (answer,) = query_tokens(store, [pod], tokens + [0])
        answers.append(answer)
    return answers
