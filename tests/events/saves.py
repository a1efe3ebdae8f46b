"""What the events tests share: prompts, the objects a connector saves for them (metas with parents, and the tokens and
the engine's hash on the anchor group's kv chunks and tails in rank 0), a stand-in for the engine's block hash, and a
router's index that fails on any event sent twice or out of order."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from tiercache.client import Chunk
from tiercache.events.blocks import AllBlocksCleared, BlockRemoved, BlockStored
from tiercache.prefix.hashes import token_bytes
from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_meta, object_ref

N, U = 32, 8


def prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).sample(range(1, 50_000), length)


def spec_of(layout: ModelLayout, rank: int = 0, ranks: int = 1) -> CacheSpec:
    return CacheSpec(dataclasses.replace(layout, tp_rank=rank, tp_size=ranks), N, U)


def engine_hash(tokens, position: int) -> int:
    """A stand-in for vLLM's hash of the block ending at `position` (any function of the prefix will do)."""
    return hash(tuple(tokens[:position])) & (2**64 - 1) or 1


def refs(spec: CacheSpec, tokens, kv: int = 0, states=(), tails=()):
    hashes = spec.hashes(np.asarray(tokens))
    shape = spec.shape
    found = [object_ref(shape, hashes, ObjectKind.KV, k * N, g) for k in range(1, kv + 1) for g in shape.attention]
    for p in states:
        found += [object_ref(shape, hashes, ObjectKind.STATE, p, g) for g in shape.recurrent]
    for p in tails:
        found += [object_ref(shape, hashes, ObjectKind.TAIL, p, g) for g in shape.attention]
    return found


def chunks(spec: CacheSpec, tokens, kv: int = 0, states=(), tails=(), payload_bytes: int = 1000,
           engine: bool = True) -> list[Chunk]:
    """The chunks a connector saves, named by `spec` (rank 0's: every rank uses its keys); `engine`: with tokens and
    hashes on the anchor group's kv chunks and tails (rank 0 sends them, the other ranks do not)."""
    out = []
    for ref in refs(spec, tokens, kv, states, tails):
        meta = object_meta(ref)
        if engine and ref.group == spec.shape.anchor and ref.kind is not ObjectKind.STATE:
            eh = engine_hash(tokens, ref.position) if ref.kind is ObjectKind.KV else 0
            meta = meta._replace(tokens=token_bytes(tokens[ref.start:ref.position]), engine_hash=eh)
        out.append(Chunk(ref.key, random.Random(ref.key).randbytes(payload_bytes), meta))
    return out


def from_map(event: dict):
    """An event as vLLM's map form carries it, as the index's own type (for Router)."""
    kind = event["type"]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(event["block_hashes"]), event["medium"], event["group_idx"], event["locality"])
    return BlockStored(tuple(event["block_hashes"]), event["parent_block_hash"], tuple(event["token_ids"]),
                       event["block_size"], event["medium"], event["group_idx"], event["kv_cache_spec_kind"],
                       event["locality"], event.get("kv_cache_spec_sliding_window"))


class Router:
    """Applies a pod's events as a router index does, and fails on anything sent twice or out of order: a store of a
    (hash, group, medium) already held, a removal of one not held, a block whose parent it does not hold."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int, str], BlockStored] = {}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, dict):
                event = from_map(event)
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                (h,) = event.block_hashes
                assert (h, event.group_idx, event.medium) not in self.held, event
                if event.kind != "mamba" and event.parent_block_hash is not None:
                    assert any(k[0] == event.parent_block_hash and k[1] == event.group_idx for k in self.held), event
                assert len(event.token_ids) == event.block_size and h != 0, event
                self.held[(h, event.group_idx, event.medium)] = event
            else:
                (h,) = event.block_hashes
                assert self.held.pop((h, event.group_idx, event.medium), None) is not None, event

    def blocks(self, group: int, kind: str = "full_attention") -> dict[int, str]:
        return {h: e.medium for (h, g, _), e in self.held.items() if g == group and e.kind == kind}
