"""What a router is told: the pods, vLLM's block events, and how a block is named and labelled in them.

The events are vLLM's (vllm.distributed.kv_events: BlockStored, BlockRemoved, AllBlocksCleared), encoded for the
wire by tiercache.events.vllm_wire. What a block is called: the engine's own block hash and token ids, which
connectors send with the anchor group's kv chunks in rank 0 (ChunkMeta.tokens, engine_hash). Without an engine hash,
the first 8 bytes of tiercache's chain hash stand in (unique within a pod's stream; routers recompute their keys from
the tokens anyway). Hash 0 is never published (llm-d reads 0 as "no parent").
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from tiercache.prefix.layout import GroupKind
from tiercache.prefix.objects import ChainShape

# vLLM's media (vllm.distributed.kv_events): a router reads GPU as "in the engine's own memory", so every tier of
# tiercache is CPU or STORAGE, with the locality as seen from the pod (docs/events.md, "What is published").
MEDIUM_BY_TIER = {"gpu": "CPU", "host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}
KIND_BY_GROUP = {GroupKind.FULL_ATTENTION: "full_attention", GroupKind.SLIDING_WINDOW: "sliding_window",
                 GroupKind.RECURRENT: "mamba"}


@dataclass(frozen=True)
class Pod:
    """One engine instance as a router sees it: its id and model (llm-d's topic `kv@<pod>@<model>`), its rank
    namespaces (an object counts only when every rank holds its shard; the first rank's kv chunks carry the tokens),
    the layout's shape, vLLM's KV cache group index for each layout group, whether it runs on this server's node, and
    the match unit u its namespaces hash with (the pod query hashes prompts as the pod's connector does)."""

    pod_id: str
    model_name: str
    namespaces: tuple[str, ...]
    shape: ChainShape
    engine_groups: tuple[int, ...]
    dp_rank: int = 0
    same_node: bool = True
    match_unit: int = 16


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    group_idx: int
    kind: str
    locality: str
    sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str
    group_idx: int
    locality: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class Advert:
    """One advertised (block, group): what its BlockStored says, and what its BlockRemoved must repeat."""

    stored: BlockStored

    def removed(self) -> BlockRemoved:
        s = self.stored
        return BlockRemoved(s.block_hashes, s.medium, s.group_idx, s.locality)

    @property
    def is_attention(self) -> bool:
        return self.stored.kind != "mamba"


def published_hash(engine_hash: int, prefix_hash: bytes) -> int:
    """The engine's hash, or the first 8 bytes of tiercache's chain hash; never 0 (llm-d's "no parent")."""
    value = engine_hash or int.from_bytes(prefix_hash[:8], "big")
    return value or 1


def checkpoint_hash(prefix_hash: bytes) -> int:
    """The published hash of a checkpoint at a block boundary: never its block's (tiercache.events.adverts says why),
    never 0."""
    return xxhash.xxh3_64_intdigest(prefix_hash + b"state") or 1


def token_ids(tokens: bytes) -> tuple[int, ...]:
    """The token ids a chunk's meta carries (little-endian uint32)."""
    return tuple(memoryview(tokens).cast("I")) if tokens else ()
