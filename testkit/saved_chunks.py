"""The objects a connector saves for a prompt, made without an engine: the events tests put them into real servers
(tests/events, tests/vllm, tests/dynamo), and so do the router-agreement harness (testkit/router_agreement.py) and
the lab's fleet router tests. Metas with parents, and the tokens and the engine's hash on the anchor group's kv chunks
and tails in rank 0; prompts of distinct token ids; a stand-in for the engine's block hash."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from tiercache.client import Chunk
from tiercache.prefix.hashes import token_bytes
from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.objects import CacheSpec, ObjectKind, object_meta, object_ref

N, U = 32, 8


def prompt(seed: int, length: int) -> list[int]:
    """`length` distinct token ids (no engine's vocabulary: the saves only hash them)."""
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
