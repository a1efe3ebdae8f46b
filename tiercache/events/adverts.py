"""What a block node advertises, and the events that turn a tree's old adverts into its new ones.

A node advertises one BlockStored per attention group that holds its kv chunk (the group's medium and locality), and
one `mamba` block per recurrent group for each restorable checkpoint under it (vLLM's kind for recurrent groups, for
routers that learn to read them). The events between two sets of adverts are ordered as a walk of the whole tree
would order them: removals deepest first (a removal never leaves a child without its parent), then stores parents
first (a router knows a block's parent before the block); a (block, group) whose medium or locality changes is
removed from the old and stored in the new. So every transition is sent exactly once, as llm-d's refcounted removals
need (tests/events/test_incremental.py compares them with a recompute from nothing).
"""

from __future__ import annotations

from typing import Iterable

from tiercache.events.blocks import (KIND_BY_GROUP, MEDIUM_BY_TIER, Advert, BlockStored, Event, Pod, checkpoint_hash,
                                     published_hash, token_ids)
from tiercache.events.tree import Adverts, BlockNode, PodTrees, walk_order
from tiercache.prefix.objects import ObjectKind, object_key
from tiercache.store.chain import StoreChain


class Advertiser:
    """`shared_tiers`: the tiers other nodes read too (their blocks are REMOTE to every pod). `medium_override`: the
    medium every block is labelled with instead of its tier's (events.medium_override)."""

    def __init__(self, shared_tiers: frozenset[str], medium_override: str = "") -> None:
        self._shared = shared_tiers
        self._medium_override = medium_override
        self.nodes = 0  # nodes whose adverts were redone (each asks where its objects are)

    def events(self, trees: PodTrees, view: StoreChain, touched: Iterable[BlockNode],
               dropped: list[BlockNode]) -> list[Event]:
        """The new adverts of the touched nodes (in pre-order: a parent's published hash first), and the events that
        turn the old adverts of the touched and dropped nodes into them."""
        orders: dict[int, tuple[bytes, ...]] = {}
        removals: list[tuple[tuple[bytes, ...], int, Event]] = []
        stores: list[tuple[tuple[bytes, ...], int, Event]] = []
        for node in dropped:
            order = walk_order(node, orders)
            removals += [(order, i, advert.removed()) for i, advert in enumerate(node.adverts.values())]
            trees.set_adverts(node, {})
        for node in sorted(touched, key=lambda n: walk_order(n, orders)):
            order = walk_order(node, orders)
            new = self.adverts(trees, view, node)
            old = node.adverts
            for i, (key, advert) in enumerate(old.items()):
                after = new.get(key)
                if after is None or after.stored != advert.stored:
                    removals.append((order, i, advert.removed()))
            for i, (key, advert) in enumerate(new.items()):
                before = old.get(key)
                if before is None or before.stored != advert.stored:
                    stores.append((order, i, advert.stored))
            trees.set_adverts(node, new)
        removals.sort(key=lambda r: (r[0], r[1]), reverse=True)
        stores.sort(key=lambda r: (r[0], r[1]))
        return [event for *_, event in removals] + [event for *_, event in stores]

    def adverts(self, trees: PodTrees, view: StoreChain, node: BlockNode) -> Adverts:
        """A node's adverts (its parent's published hash being current), and its own published hash set. Blocks
        without tokens are not advertised: routers cannot key them."""
        pod, shape = trees.pod, trees.pod.shape
        up, meta = node.up, node.meta
        self.nodes += 1
        if not node.advertised or not meta.tokens or (up is not None and up.published is None):
            node.published = None
            return {}
        block_hash = node.published = published_hash(meta.engine_hash, node.hash)
        view.children(trees.anchor_key(node.hash))  # the metas of its tails (checkpoint_adverts)
        parent_hash = up.published if up is not None else None
        tokens = token_ids(meta.tokens)
        adverts: Adverts = {}
        for group in shape.attention:
            where = view.tier(object_key(node.hash, ObjectKind.KV, group))
            if where is None:
                continue  # a sliding-window chunk out of every hit's window: held or not, nothing to say
            medium, locality = self._medium(pod, where)
            stored = BlockStored((block_hash,), parent_hash, tokens, shape.chunk_tokens, medium,
                                 pod.engine_groups[group], KIND_BY_GROUP[shape.kinds[group]], locality,
                                 shape.windows[group])
            adverts[(node.hash, group)] = Advert(stored)
        for position, checkpoint in node.restorable:
            adverts.update(self._checkpoint_adverts(trees, view, checkpoint, position, node.depth, block_hash))
        return adverts

    def _checkpoint_adverts(self, trees: PodTrees, view: StoreChain, checkpoint: bytes, position: int, depth: int,
                            block_hash: int) -> Adverts:
        """The checkpoint's own `mamba` blocks, one per recurrent group: a hash of its own, the block that ends at or
        before it as parent, and the tokens since that block's end (the anchor tail's; none at a boundary). Never
        the attention block's hash or tokens: Dynamo 1.6.1 indexes mamba blocks like attention ones, by their
        tokens, and applies a BlockRemoved to a hash whatever its group, so a checkpoint named or spelled like its
        block would merge with it, and a lost state would take the block with it."""
        pod, shape = trees.pod, trees.pod.shape
        n = shape.chunk_tokens
        if not shape.recurrent or not checkpoint:
            return {}
        if position == depth * n:
            own, tokens, size = checkpoint_hash(checkpoint), (), 0
        else:
            tail = view.meta_of(object_key(checkpoint, ObjectKind.TAIL, trees.anchor))
            if tail is None or not tail.tokens:
                return {}
            own, tokens, size = published_hash(0, checkpoint), token_ids(tail.tokens), position - depth * n
        adverts: Adverts = {}
        for group in shape.recurrent:
            where = view.tier(object_key(checkpoint, ObjectKind.STATE, group))
            if where is None:
                continue
            medium, locality = self._medium(pod, where)
            stored = BlockStored((own,), block_hash, tokens, size, medium, pod.engine_groups[group], "mamba", locality)
            adverts[(checkpoint, group)] = Advert(stored)
        return adverts

    def _medium(self, pod: Pod, tier: str) -> tuple[str, str]:
        local = pod.same_node and tier not in self._shared
        return self._medium_override or MEDIUM_BY_TIER.get(tier, "STORAGE"), "LOCAL" if local else "REMOTE"

