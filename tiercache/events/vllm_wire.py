"""KV events in vLLM's wire format (vllm/distributed/kv_events.py, as vLLM 0.33 encodes them), written with msgpack.

A batch is the msgpack array `[ts, events, data_parallel_rank]` (vLLM's EventBatch is `array_like`); each event a map
tagged with a "type" key (vLLM's KVCacheEvent is a tagged msgspec struct without `array_like`; the map form since
vllm#42892, which llm-d's and Dynamo's adapters read). Fields without a default are always written, None included;
fields with one only when they differ from it, as msgspec's `omit_defaults` does. tests/vllm/test_events.py decodes
every event the server sends with vLLM's own classes.

`encoding="array"` writes each event as older vLLMs did (and as Dynamo's zmq_wire README documents): the positional
array `[tag, field, ...]` in vLLM's own field order, trailing fields left out while they hold their defaults (what
msgspec's `array_like=True, tag=True, omit_defaults=True` writes; tests/vllm decodes it with a mirror struct built
from vLLM's classes' field order).
"""

from __future__ import annotations

import time

import msgpack

from tiercache.events.blocks import AllBlocksCleared, BlockRemoved, BlockStored, Event


def event_map(event: Event) -> dict:
    if isinstance(event, BlockStored):
        fields = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                  "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                  "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None,
                  "group_idx": event.group_idx, "kv_cache_spec_kind": event.kind}
        if event.sliding_window is not None:
            fields["kv_cache_spec_sliding_window"] = event.sliding_window
        fields["locality"] = event.locality
        return fields
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium,
                "group_idx": event.group_idx, "locality": event.locality}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


# vLLM 0.33's field order (the class attributes' order), up to the last field tiercache writes; the fields before it
# with defaults are written as None, as the positional form must.
STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")
STORED_REQUIRED = 7  # block_hashes .. lora_name have no default
REMOVED_ORDER = ("block_hashes", "medium", "group_idx", "locality")
REMOVED_REQUIRED = 2


def event_array(event: Event) -> list:
    """The positional form: [tag, fields in vLLM's order], trailing defaults (None) left out."""
    fields = event_map(event)
    tag = fields.pop("type")
    order, required = {"BlockStored": (STORED_ORDER, STORED_REQUIRED),
                       "BlockRemoved": (REMOVED_ORDER, REMOVED_REQUIRED)}.get(tag, ((), 0))
    values = [fields.get(name) for name in order]
    while len(values) > required and values[-1] is None:
        values.pop()
    return [tag, *values]


def batch_payload(events: list[Event], dp_rank: int, ts: float | None = None, encoding: str = "map") -> bytes:
    """One batch's payload: `[ts, [event, ...], data_parallel_rank]`, events as maps or positional arrays."""
    encode = event_array if encoding == "array" else event_map
    return msgpack.packb([time.time() if ts is None else ts, [encode(e) for e in events], dp_rank])
