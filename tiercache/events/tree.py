"""The block trees the restorable index keeps per pod (tiercache.events.restorable), as its last flush left them, and
how they are read from the store.

A tree is everything under one first chunk: its nodes are attention blocks, each the anchor group's kv chunk ending
at depth*N in the pod's first namespace, named by the chain hash of that prefix (prefix.hashes). A node knows its
parent node, its children (sorted: a walk visits the last first), its restorable checkpoints, whether it is advertised
(a restorable checkpoint at or below it), its published hash and its adverts (tiercache.events.adverts).
"""

from __future__ import annotations

from tiercache.events.blocks import Advert, Pod
from tiercache.prefix.hashes import root_hash
from tiercache.prefix.lookup import Query, find_hit
from tiercache.prefix.objects import ChainShape, ObjectKey, ObjectKind, object_key
from tiercache.record.encoding import ChunkMeta
from tiercache.store.chain import StoreChain

MAX_DEPTH = 1 << 20
_INVERT = bytes(range(255, -1, -1))

Adverts = dict[tuple[bytes, int], Advert]  # (chain hash of the block or checkpoint, layout group) -> advert


class BlockNode:
    __slots__ = ("hash", "meta", "depth", "up", "kids", "restorable", "advertised", "published", "adverts")

    def __init__(self, prefix_hash: bytes, meta: ChunkMeta, depth: int, up: "BlockNode | None") -> None:
        self.hash, self.meta, self.depth, self.up = prefix_hash, meta, depth, up
        self.kids: list[bytes] = []  # the children's chain hashes, sorted
        self.restorable: list[tuple[int, bytes]] = []  # (position, chain hash) of each restorable checkpoint
        self.advertised = False
        self.published: int | None = None  # the block hash its events carry; None when not published
        self.adverts: Adverts = {}

    def path(self, root: bytes) -> list[bytes]:
        """The chain hashes from the namespace's root down to this node (what find_hit is asked with)."""
        hashes, node = [], self
        while node is not None:
            hashes.append(node.hash)
            node = node.up
        return [root, *reversed(hashes)]


Tree = dict[bytes, BlockNode]  # by chain hash


class Redo:
    """What a flush must redo in one tree: the nodes whose whole subtree depends on a changed kv chunk, the nodes
    whose own checkpoints or children changed (a tail, a state, or an anchor kv child placed or lost), and the nodes
    whose adverts alone may change (a key of theirs moved to another tier). Each a set of chain hashes."""

    def __init__(self) -> None:
        self.subtrees: set[bytes] = set()
        self.nodes: set[bytes] = set()
        self.adverts: set[bytes] = set()


class PodTrees:
    """One pod's trees (by their first chunk's chain hash) and its advertised attention blocks by published hash."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self.anchor = pod.shape.anchor
        self.root = root_hash(pod.namespaces[0])
        self.root_key = self.anchor_key(self.root)
        self.trees: dict[bytes, Tree] = {}
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # block hash -> (parent hash, tokens)

    def anchor_key(self, prefix_hash: bytes) -> bytes:
        """The key of the anchor group's kv object at a chain hash: a node's object in the store."""
        return object_key(prefix_hash, ObjectKind.KV, self.anchor)

    def set_adverts(self, node: BlockNode, adverts: Adverts) -> None:
        """Replace a node's adverts, and its attention block in `blocks` (RestorableIndex.tokens_of)."""
        old = next((a.stored for a in node.adverts.values() if a.is_attention), None)
        if old is not None:
            self.blocks.pop(old.block_hashes[0], None)
        new = next((a.stored for a in adverts.values() if a.is_attention), None)
        if new is not None:
            self.blocks[new.block_hashes[0]] = (new.parent_block_hash, new.token_ids)
        node.adverts = adverts


def preorder(tree: Tree, prefix_hash: bytes) -> list[BlockNode]:
    """The nodes of the subtree at `prefix_hash` in the walk's order (children pushed sorted: the last is visited
    first)."""
    out: list[BlockNode] = []
    stack = [prefix_hash]
    while stack:
        node = tree.get(stack.pop())
        if node is not None:
            out.append(node)
            stack += node.kids
    return out


def cut(tree: Tree, prefix_hash: bytes) -> list[BlockNode]:
    """Take the subtree at `prefix_hash` out of the tree; its nodes."""
    nodes = preorder(tree, prefix_hash)
    for node in nodes:
        del tree[node.hash]
    return nodes


def walk_order(node: BlockNode, orders: dict[int, tuple[bytes, ...]]) -> tuple[bytes, ...]:
    """A node's place in the walk's pre-order, as a sortable key: its path of hashes from the first chunk, each
    inverted (siblings are visited largest first); `orders` keeps those computed by one diff."""
    chain = []
    while node is not None and id(node) not in orders:
        chain.append(node)
        node = node.up
    order = orders[id(node)] if node is not None else ()
    for node in reversed(chain):
        order = orders[id(node)] = order + (node.hash.translate(_INVERT),)
    return order


class TreeReader:
    """Reads a pod's tree from the store's directory (through the Lookup's own view), and counts what it reads:
    nodes (children read, checkpoints tried) and find_hit searches (RestorableIndex.effort)."""

    def __init__(self) -> None:
        self.nodes = 0
        self.searches = 0

    def rebuild(self, trees: PodTrees, view: StoreChain, tree: Tree, key: bytes, meta: ChunkMeta, depth: int,
                 up: BlockNode | None) -> list[BlockNode]:
        """Recompute the subtree at `key` from the store's directory: its nodes, in pre-order."""
        nodes: list[BlockNode] = []
        stack = [(key, meta, depth, up)]
        while stack:
            key, meta, depth, up = stack.pop()
            node = tree.get(key)
            if node is None:
                node = tree[key] = BlockNode(key, meta, depth, up)
            else:
                node.meta, node.depth, node.up = meta, depth, up
            self.read_node(trees, view, node)
            nodes.append(node)
            stack += [(kid, view.meta_of(trees.anchor_key(kid)), depth + 1, node) for kid in node.kids]
        return nodes

    def read_node(self, trees: PodTrees, view: StoreChain, node: BlockNode) -> None:
        """A node's children and restorable checkpoints, from the store."""
        self.nodes += 1
        children = [(child, meta) for child, meta in
                    ((ObjectKey.parse(key), meta) for key, meta in view.children(trees.anchor_key(node.hash)))
                    if child is not None]
        node.kids = [child.prefix_hash for child, _ in children if child.kind is ObjectKind.KV
                     and child.group == trees.anchor and node.depth < MAX_DEPTH]
        node.restorable = []
        path = node.path(trees.root)
        for position, checkpoint in _checkpoint_candidates(trees.pod.shape, node.depth, children):
            self.searches += 1
            if _resumes_at(trees.pod.shape, path, position, checkpoint, view):
                node.restorable.append((position, checkpoint))


def _checkpoint_candidates(shape: ChainShape, depth: int, children) -> list[tuple[int, bytes]]:
    """(position, chain hash) of the checkpoints to try under a kv node at depth*N, deepest first: where states were
    saved (a tail alone is no checkpoint of a hybrid model); for a model without recurrent groups the boundary itself
    (a tail there adds no block)."""
    if not shape.recurrent:
        return [(depth * shape.chunk_tokens, b"")]
    found = {(meta.prefix_tokens, child.prefix_hash) for child, meta in children if child.kind is ObjectKind.STATE}
    return sorted(found, reverse=True)


def _resumes_at(shape: ChainShape, path: list[bytes], p: int, checkpoint: bytes, view: StoreChain) -> bool:
    """Whether a prompt ending right after position p (its chain `path` down to p's block, `checkpoint` the chain
    hash at p) resumes at p: the Lookup search, asked exactly that."""
    n = shape.chunk_tokens
    positions = {p: checkpoint} if p % n else {}
    return find_hit(Query(shape, p + 1, path[:p // n + 1], positions), view).tokens == p


def listed(view: StoreChain, trees: PodTrees, parent: bytes, key: bytes) -> ChunkMeta | None:
    """The meta of node `key` if the store lists it among node `parent`'s children now."""
    view.children(trees.anchor_key(parent))
    return view.meta_of(trees.anchor_key(key))
