"""The hit rule: what must be present to resume a prompt at position p, and what a hit is.

The hit is the largest p such that each full-attention group has every kv chunk up to N*floor(p/N), each sliding-window
group has the chunks overlapping [p-W, p), the tail exists when p is not a multiple of N, and the state exists when the
model has recurrent layers. Which positions can hold a hit? Chunk boundaries (kv chains and boundary states) and the
positions where earlier requests ended (tails and states saved at a prompt's last token and at a request's end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from tiercache.prefix.layout import GroupKind
from tiercache.prefix.objects import ObjectKind, ObjectRef, key_suffix, object_ref, ref_with_parent, shape_of


@dataclass(frozen=True)
class Located:
    ref: ObjectRef
    tier: str


@dataclass(frozen=True)
class Hit:
    """The result of a lookup: reuse `tokens` of `prompt_tokens`, by loading `objects` (with the tier of each).

    `chain_chunks`: how many kv chunks of the prompt every attention group holds from the start (the server walked
    them): admission need not save those again."""

    tokens: int
    prompt_tokens: int
    objects: tuple[Located, ...] = ()
    chain_chunks: int = 0

    @property
    def ratio(self) -> float:
        return self.tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tokens_by_tier(self) -> dict[str, int]:
        return tokens_by_tier(self.tokens, (HitObject(o.ref.kind, o.ref.group, o.ref.tokens, o.tier)
                                            for o in self.objects))

    def loaded_tokens_by_tier(self, held: int) -> dict[str, int]:
        """The hit's tokens past `held` (the prefix the engine holds itself) by the tier they come from: what loading
        the hit gives an engine that already has `held` tokens."""
        if held >= self.tokens:
            return {}
        beyond = (HitObject(o.ref.kind, o.ref.group, max(0, o.ref.position - max(o.ref.start, held)), o.tier)
                  for o in self.objects)
        return {tier: n for tier, n in tokens_by_tier(self.tokens - held, beyond).items() if n}


class HitObject(NamedTuple):
    """One object of a hit as the search found it: its kind and layer group, the tokens of KV it holds (0 for a
    state), and the tier it is in."""

    kind: ObjectKind
    group: int
    tokens: int
    tier: str


def tokens_by_tier(hit_tokens: int, objects: Iterable[HitObject]) -> dict[str, int]:
    """Hit tokens attributed to the tier their KV came from (the first attention group's objects; the state counts
    for the tokens no KV covers)."""
    by_tier: dict[str, int] = {}
    first_group = None
    state_tier = None
    for kind, group, tokens, tier in objects:
        if kind is ObjectKind.STATE:
            state_tier = tier
            continue
        first_group = group if first_group is None else first_group
        if group == first_group:
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    covered = sum(by_tier.values())
    if covered < hit_tokens and state_tier is not None:
        by_tier[state_tier] = by_tier.get(state_tier, 0) + hit_tokens - covered
    return by_tier


def required_objects(spec, hashes, p: int) -> list[ObjectRef]:
    """What must be loaded to resume at p: the hit rule, spelled out per layer group (kv chunks in order, then the
    tail, per attention group; the state for the recurrent group). `spec`: a CacheSpec or a ChainShape.

    (Built inline rather than through object_ref: a 262,144-token hit names ~500 objects per group, and this is on
    every lookup's path.)"""
    shape = shape_of(spec)
    n = shape.chunk_tokens
    at = hashes.at
    needed: list[ObjectRef] = []
    for group, kind in enumerate(shape.kinds):
        if kind is GroupKind.RECURRENT:
            needed.append(object_ref(shape, hashes, ObjectKind.STATE, p, group))
            continue
        first = shape.first_chunk(group, p)
        suffix = key_suffix(ObjectKind.KV, group)
        chain = [at(k * n) + suffix for k in range(first - 1, p // n + 1)]  # kv keys (and h(0)'s root) in order
        needed += [ObjectRef(k * n, ObjectKind.KV, group, chain[i + 1], k * n - n, chain[i])
                   for i, k in enumerate(range(first, p // n + 1))]
        if p % n:
            needed.append(object_ref(shape, hashes, ObjectKind.TAIL, p, group))
    return needed


def checkpoint_objects(spec, hashes, p: int) -> list[ObjectRef]:
    """The checkpoint objects at position p: a tail per attention group (between boundaries), and the state."""
    shape = shape_of(spec)
    n = shape.chunk_tokens
    prefix_hash, below = hashes.at(p), hashes.at(p - p % n)
    kinds = {group: ObjectKind.STATE if kind is GroupKind.RECURRENT else ObjectKind.TAIL
             for group, kind in enumerate(shape.kinds) if kind is GroupKind.RECURRENT or p % n}
    return [ref_with_parent(n, prefix_hash, below, kind, p, group, shape.anchor) for group, kind in kinds.items()]
