"""Redoing one pod's block tree (tiercache.events.tree) after the restorable index's flush
(tiercache.events.restorable, whose docstring says what a change can alter): the nodes whose own checkpoints or
children changed are read again, the subtrees under a changed kv chunk rebuilt from the store, the advertised flags
redone upwards until one stays as it was, and the adverts of just those nodes diffed into events
(tiercache.events.adverts). A checkpoint is restorable when the Lookup call's own search says so, over the Lookup's
own view of the store (tiercache.store.chain.StoreChain). tests/events/test_incremental.py holds every flush to what
a recompute of the whole tree would send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tiercache.events.adverts import Advertiser
from tiercache.events.blocks import Event
from tiercache.events.tree import BlockNode, PodTrees, Redo, Tree, TreeReader, cut, listed, preorder
from tiercache.prefix.objects import ObjectKey
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.chain import StoreChain
from tiercache.store.tiered import TieredStore


class Effort(NamedTuple):
    """What the index has done since it started (tests, profiles): nodes read again (children, checkpoints tried),
    find_hit searches, and nodes whose adverts were redone. A flush after one put costs O(depth), not O(tree)."""

    nodes: int
    searches: int
    adverts: int


@dataclass
class KnownKeys:
    """What the index knows of the keys it watches, between flushes: every key's parent (a lost key's too, briefly),
    the first chunks' metas (their tokens: where a tree's walk starts), and whether the last search that asked found
    each key held (the searches' memo)."""

    parents: dict[ChunkKey, ChunkKey | None] = field(default_factory=dict)
    first_metas: dict[ChunkKey, ChunkMeta] = field(default_factory=dict)
    held: dict[ChunkKey, bool] = field(default_factory=dict)


class Recompute:
    """Redoes a pod's trees over `store`, reading what the index knows of the keys (`known`, which only the index
    writes). `attention_only`: every attention block held from the root is advertised, whatever the checkpoints
    (events.advertise "attention"); `medium_override`: the medium every block is labelled with
    (events.medium_override)."""

    def __init__(self, store: TieredStore, known: KnownKeys, attention_only: bool, medium_override: str) -> None:
        self._store = store
        self._known = known
        self._attention_only = attention_only
        self._advertiser = Advertiser(frozenset(t.name for t in store.tiers if t.shared_by_nodes), medium_override)
        self._reader = TreeReader()

    @property
    def effort(self) -> Effort:
        return Effort(self._reader.nodes, self._reader.searches, self._advertiser.nodes)

    def redo_tree(self, trees: PodTrees, first: bytes, redo: Redo) -> list[Event]:
        """Redo what `redo` can alter in one tree, then diff the adverts of the nodes that may have changed: the
        events a recompute of the whole tree would send."""
        pod = trees.pod
        view = StoreChain(self._store, pod.namespaces, memo=True, seen=self._known.held)
        tree = trees.trees.setdefault(first, {})
        first_meta = self._known.first_metas.get(ChunkKey(pod.namespaces[0], trees.anchor_key(first)))
        touched: dict[bytes, BlockNode] = {}  # nodes whose adverts may change
        dropped: list[BlockNode] = []  # nodes no longer in the tree
        if first_meta is None:
            dropped = cut(tree, first)
        else:
            if first not in tree:
                redo.subtrees.add(first)
            dropped += self._redo_nodes(trees, view, tree, redo, touched)
            dropped += self._redo_subtrees(trees, view, tree, first, first_meta, redo, touched)
            touched.update((key, tree[key]) for key in redo.adverts if key in tree)
            touched = {key: node for key, node in touched.items() if tree.get(key) is node}
            self._reflag_upwards(trees, view, tree, touched)
        if not tree:
            del trees.trees[first]
        return self._advertiser.events(trees, view, touched.values(), dropped)

    def _redo_nodes(self, trees: PodTrees, view: StoreChain, tree: Tree, redo: Redo,
                    touched: dict[bytes, BlockNode]) -> list[BlockNode]:
        """Read again the nodes whose own checkpoints or children changed, shallowest first (a lost child takes its
        subtree; a new one's subtree is added to redo); the nodes dropped."""
        dropped: list[BlockNode] = []
        for key in sorted(redo.nodes & tree.keys(), key=lambda k: tree[k].depth):
            node = tree.get(key)
            if node is None:
                continue  # it went with an ancestor's lost child
            kids = node.kids
            self._reader.read_node(trees, view, node)
            for kid in set(kids).difference(node.kids):
                dropped += cut(tree, kid)
            redo.subtrees.update(set(node.kids).difference(kids))
            touched[key] = node
        return dropped

    def _redo_subtrees(self, trees: PodTrees, view: StoreChain, tree: Tree, first: bytes, first_meta: ChunkMeta,
                       redo: Redo, touched: dict[bytes, BlockNode]) -> list[BlockNode]:
        """Rebuild the subtrees under a changed kv chunk from the store, shallowest first (one inside another is
        walked once); the nodes dropped."""
        roots: list[tuple[int, bytes, BlockNode | None]] = []
        for key in redo.subtrees:
            node = tree.get(key)
            if key == first:
                roots.append((1, key, None))
            elif node is not None:
                roots.append((node.depth, key, node.up))
            else:
                parent = self._known.parents.get(ChunkKey(trees.pod.namespaces[0], trees.anchor_key(key)))
                up_key = ObjectKey.parse(parent.key) if parent is not None else None
                up = tree.get(up_key.prefix_hash) if up_key is not None else None
                if up is not None and key in up.kids:
                    roots.append((up.depth + 1, key, up))
        dropped: list[BlockNode] = []
        rebuilt: dict[bytes, BlockNode] = {}
        for depth, key, up in sorted(roots, key=lambda r: (r[0], r[1])):
            if key in rebuilt:
                continue
            meta = first_meta if up is None else listed(view, trees, up.hash, key)
            if meta is None:
                dropped += cut(tree, key)
                continue
            before = {node.hash: node for node in preorder(tree, key)}
            nodes = self._reader.rebuild(trees, view, tree, key, meta, depth, up)
            rebuilt.update((node.hash, node) for node in nodes)
            dropped += [node for k, node in before.items() if k not in rebuilt and tree.pop(k, None) is node]
            for node in reversed(nodes):  # children first
                node.advertised = self._advertised(trees, view, tree, node)
            touched[key] = nodes[0]
        touched.update(rebuilt)
        return dropped

    def _reflag_upwards(self, trees: PodTrees, view: StoreChain, tree: Tree, touched: dict[bytes, BlockNode]) -> None:
        """A block is advertised iff a restorable checkpoint is at or below it: up from each changed node until a
        flag stays as it was (deepest first, so that every child's flag is final when its parent's is read)."""
        for node in sorted(touched.values(), key=lambda n: n.depth, reverse=True):
            node.advertised = self._advertised(trees, view, tree, node)
            up = node.up
            while up is not None:
                flag = self._advertised(trees, view, tree, up)
                if flag == up.advertised:
                    break
                up.advertised = flag
                touched[up.hash] = up
                up = up.up

    def _advertised(self, trees: PodTrees, view: StoreChain, tree: Tree, node: BlockNode) -> bool:
        """Whether a node is advertised, its children's flags being final."""
        if self._attention_only:  # held in every rank, whatever the checkpoints (published only from the root)
            return view.tier(trees.anchor_key(node.hash)) is not None
        return bool(node.restorable) or any(tree[kid].advertised for kid in node.kids if kid in tree)
