"""A router's index for the events tests: applies a pod's events as a router index does, and fails on anything sent
twice or out of order (the saves it follows: testkit/saved_chunks.py)."""

from __future__ import annotations

from tiercache.events.blocks import AllBlocksCleared, BlockRemoved, BlockStored


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
