"""The restorable index: which attention blocks each pod can restore from this server, as vLLM-style block events.

A router (llm-d, Dynamo) counts a pod's cached attention blocks from the start of a prompt. For a hybrid model an
attention block is worth nothing without a recurrent checkpoint at or after it, so a block is *advertised* iff a
checkpoint at or after it on its branch satisfies the whole hit rule for the pod: every attention group's kv chain in
every rank namespace, the tail when mid-block, the state when recurrent. That is decided by the very search behind
the Lookup call (tiercache.prefix.lookup.find_hit, asked "does a prompt ending right after checkpoint p resume at
p?"), never by a second hit rule. A pure-attention model has no checkpoints: a block is advertised when its kv chain
is complete (its boundary resumes). tests/events/test_restorable.py checks these rules.

How it stays current. The store tells the index of every change of where a key is held (TieredStore.watch); the
index notes them and, at each `flush`, redoes only what those changes can alter. A tree is everything under one first
chunk (the anchor group's kv object at N of the pod's first namespace), read from the store's directory (children by
parent); the index keeps each tree's nodes (one per anchor kv chunk: its children, restorable checkpoints, advertised
flag, published hash and adverts) as the last flush left them. A change at key X can alter:
- when X was placed or lost: if X is a kv chunk (any group, any rank: the hit rule needs the whole chain), the
  restorable checkpoints of every node whose path holds X's node, so X's node's subtree is read again; if X is a
  tail or a state, the checkpoints of its own node only; and if X is an anchor kv chunk of the first namespace, its
  parent's children (a lost one takes its subtree out of the tree);
- the advertised flag of the ancestors of what was redone (a block is advertised iff a restorable checkpoint is at
  or below it): redone from the node up until a flag stays as it was;
- when X, a kv chunk whose node is in the tree, only moved (every search so far saw it held and it is held now, in
  whatever tier: demoted, promoted, put again), the media of its own node's adverts alone (the hit rule asks whether
  a key is held, never where). A tail or state is always read again with its node (a few searches).
Then the adverts of just those nodes are redone, parents first, and compared with their old ones; the difference
becomes events, ordered as a walk of the whole tree would order them: BlockStored for a (block, group) that becomes
advertised, BlockRemoved for one that stops being so, both (removed from the old medium, stored in the new) for one
whose medium or locality changes, removals deepest first, then stores parents first. So every transition is sent
exactly once, as llm-d's refcounted removals need. What a flush costs: for a put at a leaf, reading the leaf and its
parent (a find_hit per checkpoint there) and a walk up its path; a chunk placed or lost high in a tree re-reads the
subtree below it (as it must: every hit through it changed). `work` counts it. Checkpoints themselves are published
as `mamba` blocks (vLLM's kind for recurrent groups) for routers that learn to read them.

What a block is called: the engine's own block hash and token ids, which connectors send with the anchor group's kv
chunks in rank 0 (ChunkMeta.tokens, engine_hash). Without an engine hash, the first 8 bytes of tiercache's chain
hash stand in (unique within a pod's stream; routers recompute their keys from the tokens anyway). Blocks without
tokens are not advertised: routers cannot key them. Hash 0 is never published (llm-d reads 0 as "no parent").

Thread-safety: `note` runs on the store's threads and only queues; every other call takes one lock (`_work`), so
the publisher's thread (flushes, replays) and RPC threads (pods registering, pod queries by hash) take turns.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from tiercache.prefix.layout import GroupKind
from tiercache.prefix.lookup import Query, find_hit
from tiercache.prefix.objects import ChainShape, ObjectKind, object_key
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore

# vLLM's media (vllm.distributed.kv_events): a router reads GPU as "in the engine's own memory", so every tier of
# tiercache is CPU or STORAGE, with the locality as seen from the pod (docs/events.md, "What is published").
MEDIUM_BY_TIER = {"gpu": "CPU", "host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}
KIND_BY_GROUP = {GroupKind.FULL_ATTENTION: "full_attention", GroupKind.SLIDING_WINDOW: "sliding_window",
                 GroupKind.RECURRENT: "mamba"}
_KEY_BYTES = 18  # chain hash (16), kind, group: the hybrid connectors' object keys (prefix.objects)
_MAX_DEPTH = 1 << 20


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
class _Advert:
    """One advertised (block, group): what its BlockStored says, and what its BlockRemoved must repeat."""

    stored: BlockStored

    def removed(self) -> BlockRemoved:
        s = self.stored
        return BlockRemoved(s.block_hashes, s.medium, s.group_idx, s.locality)


class _Node:
    """One kv node of a tree (the anchor group's kv chunk ending at depth*N, in the pod's first namespace) as the last
    flush left it: its meta, its parent node, its anchor children (sorted: the walk visits the last first), its
    restorable checkpoints, whether it is advertised (a restorable checkpoint at or below it), its published hash
    (None when not published) and its adverts (its attention groups', then its checkpoints' mamba blocks)."""

    __slots__ = ("key", "meta", "depth", "up", "kids", "restorable", "advertised", "published", "adverts")

    def __init__(self, key: bytes, meta: ChunkMeta, depth: int, up: "_Node | None") -> None:
        self.key, self.meta, self.depth, self.up = key, meta, depth, up
        self.kids: list[bytes] = []
        self.restorable: list[tuple[int, bytes]] = []
        self.advertised = False
        self.published: int | None = None
        self.adverts: dict[tuple[bytes, int], _Advert] = {}

    def path(self, root: bytes) -> list[bytes]:
        """The chain hashes from the namespace's root down to this node (what find_hit is asked with)."""
        hashes, node = [], self
        while node is not None:
            hashes.append(node.key[:16])
            node = node.up
        return [root[:16], *reversed(hashes)]


class _Changes:
    """What a flush must redo in one tree: the nodes whose whole subtree depends on a changed kv chunk, the nodes
    whose own checkpoints or children changed (a tail, a state, or an anchor kv child placed or lost), and the nodes
    whose adverts alone may change (a key of theirs moved to another tier)."""

    def __init__(self) -> None:
        self.subtrees: set[bytes] = set()
        self.nodes: set[bytes] = set()
        self.adverts: set[bytes] = set()  # nodes whose keys only moved: their media


class _PodState:
    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        anchor = pod.shape.anchor
        self.anchor = anchor
        self.root = object_key(_root_hash(pod.namespaces[0]), ObjectKind.KV, anchor)
        self.trees: dict[bytes, dict[bytes, _Node]] = {}  # first chunk's key -> the tree's nodes by key
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # advertised block hash -> (parent, tokens)

    def node_of(self, key: bytes) -> bytes:
        """The anchor kv node of a chain hash (or of an object key), in the pod's first namespace."""
        return key[:16] + bytes((ObjectKind.KV, self.anchor))


_INVERT = bytes(range(255, -1, -1))


class Work:
    """What the index has done since it started (for tests and profiles): nodes recomputed (children read,
    checkpoints tried), find_hit searches, and nodes whose adverts were redone (each asks where its objects are). A
    flush after one put costs O(depth) of them, not O(tree)."""

    def __init__(self) -> None:
        self.nodes = 0
        self.searches = 0
        self.adverts = 0


class RestorableIndex:
    """`advertise="attention"` (events.advertise, for comparisons): every attention block whose kv chain is held
    from the root, in every attention group and rank, is advertised, with no regard to checkpoints: what an engine's
    own events say of the blocks it saved. `medium_override`: the medium every block is labelled with instead of its
    tier's (events.medium_override)."""

    def __init__(self, store: TieredStore, advertise: str = "restorable", medium_override: str = "") -> None:
        if advertise not in ("restorable", "attention"):
            raise ValueError(f"advertise must be restorable or attention, not {advertise!r}")
        self._store = store
        self._attention_only = advertise == "attention"
        self._medium_override = medium_override
        self._levels = {tier.name: level for level, tier in enumerate(store.tiers)}
        self._shared = {tier.name for tier in store.tiers if tier.shared_by_nodes}
        self._pods: dict[str, _PodState] = {}
        self._by_namespace: dict[str, list[_PodState]] = {}
        self._parents: dict[ChunkKey, ChunkKey | None] = {}  # every watched key's parent (a lost key's too, briefly)
        self._first_metas: dict[ChunkKey, ChunkMeta] = {}  # the first chunks' metas (their tokens)
        self._held: dict[ChunkKey, bool] = {}  # whether the last search that asked found each key held
        self._lock = threading.Lock()  # guards _pending and _watched, which the store's threads write
        self._pending: list[tuple[ChunkKey, ChunkMeta | None]] = []
        self._watched: frozenset[str] = frozenset()
        self.work = Work()
        self._work = threading.RLock()  # one pod change, flush or snapshot at a time (RPC threads and the publisher)
        store.watch(self.note)

    # -- what the store says ----------------------------------------------------------------------------------------

    def note(self, changes: list[tuple[ChunkKey, ChunkMeta | None]]) -> None:
        """The store's watcher: take note, nothing else (it runs on the thread of the change)."""
        with self._lock:
            watched = self._watched
            self._pending.extend(change for change in changes if change[0].namespace in watched)

    # -- pods -------------------------------------------------------------------------------------------------------

    def add_pod(self, pod: Pod) -> list[Event]:
        """Start advertising for `pod` (replacing a pod of the same id): its stream starts over with
        AllBlocksCleared and everything it can restore now."""
        with self._work:
            return self._add_pod(pod)

    def _add_pod(self, pod: Pod) -> list[Event]:
        self.remove_pod(pod.pod_id)
        state = _PodState(pod)
        self._pods[pod.pod_id] = state
        for namespace in pod.namespaces:
            self._by_namespace.setdefault(namespace, []).append(state)
        with self._lock:
            self._watched = frozenset(self._by_namespace)
        for key, meta in self._store.entries(frozenset(pod.namespaces)):
            self._learn(key, meta)
        firsts = {key.key for key, parent in self._parents.items()
                  if key.namespace == pod.namespaces[0] and parent is not None and parent.key == state.root}
        events: list[Event] = [AllBlocksCleared()]
        for first in sorted(firsts):
            changes = _Changes()
            changes.subtrees.add(first)
            events += self._update(state, first, changes)
        return events

    def remove_pod(self, pod_id: str) -> list[Event]:
        with self._work:
            return self._remove_pod(pod_id)

    def _remove_pod(self, pod_id: str) -> list[Event]:
        state = self._pods.pop(pod_id, None)
        if state is None:
            return []
        for namespace in state.pod.namespaces:
            pods = self._by_namespace[namespace]
            pods.remove(state)
            if not pods:
                del self._by_namespace[namespace]
        with self._lock:
            self._watched = frozenset(self._by_namespace)
        watched = self._watched
        for key in [k for k in self._parents if k.namespace not in watched]:
            del self._parents[key]
            self._first_metas.pop(key, None)
        for key in [k for k in self._held if k.namespace not in watched]:
            del self._held[key]
        return [AllBlocksCleared()]

    def pods(self) -> list[Pod]:
        with self._work:
            return [state.pod for state in self._pods.values()]

    def tokens_of(self, pod_id: str, block_hashes: Sequence[int]) -> list[int]:
        """The token ids of the longest leading run of `block_hashes` that the pod advertises as one chain from its
        first block (as its events published them at the last flush); [] for an unknown pod. Read-only."""
        with self._work:
            state = self._pods.get(pod_id)
            tokens: list[int] = []
            parent = None
            for block_hash in block_hashes if state is not None else ():
                block = state.blocks.get(block_hash)
                if block is None or block[0] != parent:
                    break
                tokens += block[1]
                parent = block_hash
            return tokens

    # -- events -----------------------------------------------------------------------------------------------------

    def flush(self) -> dict[str, list[Event]]:
        """Apply what the store said since the last flush: the events of each pod whose advertised set changed."""
        with self._work:
            return self._flush()

    def _flush(self) -> dict[str, list[Event]]:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return {}
        dirty: dict[str, dict[bytes, _Changes]] = {}
        last: dict[ChunkKey, ChunkMeta | None] = {}
        for key, meta in pending:
            last[key] = meta
        # A key that every search so far saw held, and that is held now, has only moved (demoted, promoted, put
        # again): the hit rule asks whether a key is held, never where. (Not "noted as placed before": a key on its
        # way down a tier can be missed by a search between its placement's note and its demotion's.)
        candidates = [key for key, meta in last.items() if meta is not None and self._held.get(key)]
        moved = {key for key, where in zip(candidates, self._store.locate(candidates) if candidates else [])
                 if where is not None}
        for key, meta in pending:  # first every parent, so that each change below finds its tree
            if meta is not None:
                self._learn(key, meta)
        for key in last:
            for state in self._by_namespace.get(key.namespace, ()):
                first = self._first_of(state, key)
                if first is not None:
                    changes = dirty.setdefault(state.pod.pod_id, {}).setdefault(first, _Changes())
                    self._mark(state, key, key in moved, changes, state.trees.get(first, {}))
        # Keys gone for good: their trees are marked, nothing needs their parents any more. (A corrupt copy that was
        # dropped may leave another below: such a key stays known.)
        gone = [key for key, meta in last.items() if meta is None]
        for key, where in zip(gone, self._store.locate(gone) if gone else []):
            if where is None:
                self._parents.pop(key, None)
                self._first_metas.pop(key, None)
                self._held.pop(key, None)
        events: dict[str, list[Event]] = {}
        for pod_id, trees in dirty.items():
            state = self._pods[pod_id]
            out = [event for first in sorted(trees) for event in self._update(state, first, trees[first])]
            if out:
                events[pod_id] = out
        return events

    def snapshot(self, pod_id: str) -> list[Event]:
        """AllBlocksCleared and a BlockStored for everything the pod has advertised (a subscriber's replay)."""
        with self._work:
            return self._snapshot(pod_id)

    def _snapshot(self, pod_id: str) -> list[Event]:
        state = self._pods.get(pod_id)
        if state is None:
            return [AllBlocksCleared()]
        return [AllBlocksCleared(), *(advert.stored for first, tree in state.trees.items()
                                      for node in _preorder(tree, first) for advert in node.adverts.values())]

    # -- the trees --------------------------------------------------------------------------------------------------

    def _learn(self, key: ChunkKey, meta: ChunkMeta) -> None:
        parent = ChunkKey(key.namespace, meta.parent) if meta.parent else None
        self._parents[key] = parent
        if parent is not None and key.key[-2:-1] == bytes((ObjectKind.KV,)) \
                and parent.key[:16] == _root_hash(key.namespace):
            self._first_metas[key] = meta  # a tree's walk starts here: the rest it reads from the store's directory

    def _first_of(self, state: _PodState, key: ChunkKey) -> bytes | None:
        """The first chunk of the tree `key` belongs to, in the pod's first namespace; None when its chain does not
        reach the root (then nothing under it is restorable, and the loss that broke it already marked its tree)."""
        if len(key.key) != _KEY_BYTES:
            return None  # not a prefix object (an opaque chunk)
        primary = state.pod.namespaces[0]
        if key.key[-2] == ObjectKind.KV:
            node = ChunkKey(primary, key.key[:16] + bytes((ObjectKind.KV, state.anchor)))
        else:
            parent = self._parents.get(key)
            if parent is None:
                return None
            node = ChunkKey(primary, parent.key[:16] + bytes((ObjectKind.KV, state.anchor)))
        for _ in range(_MAX_DEPTH):
            if node.key == state.root:
                return None  # a checkpoint before the first boundary: no block is advertised for it
            parent = self._parents.get(node)
            if parent is None:
                return None
            if parent.key == state.root:
                return node.key
            node = parent
        return None

    def _mark(self, state: _PodState, key: ChunkKey, moved: bool, changes: _Changes, tree: dict[bytes, _Node]) -> None:
        """Note in `changes` what a change at `key` can alter: a kv chunk placed or lost (any group, any rank) every
        hit through its node, so the node's subtree, or when it only moved and its node is in the tree, the node's
        adverts; a tail or state its own node's checkpoints (cheap: they are read again, moved or not). An anchor
        kv chunk placed or lost in the first namespace also adds or removes a child of its parent node."""
        node = state.node_of(key.key)
        parent = self._parents.get(key)
        if moved and key.key[-2] == ObjectKind.KV and node in tree:
            changes.adverts.add(node)
        elif key.key[-2] == ObjectKind.KV:
            changes.subtrees.add(node)
            if key.namespace == state.pod.namespaces[0] and key.key == node and parent is not None \
                    and parent.key != state.root:
                changes.nodes.add(state.node_of(parent.key))
        elif parent is not None:
            changes.nodes.add(state.node_of(parent.key))

    def _update(self, state: _PodState, first: bytes, changes: _Changes) -> list[Event]:
        """Redo what `changes` can alter in one tree, then diff the adverts of the nodes that may have changed: the
        events a recompute of the whole tree would send (removals deepest first, then stores parents first)."""
        pod = state.pod
        view = _View(self._store, pod.namespaces, self._levels, self._held)
        tree = state.trees.setdefault(first, {})
        first_meta = self._first_metas.get(ChunkKey(pod.namespaces[0], first))
        touched: dict[bytes, _Node] = {}  # nodes whose adverts may change
        dropped: list[_Node] = []  # nodes no longer in the tree
        if first_meta is None:
            dropped = _drop(tree, first)
        else:
            if first not in tree:
                changes.subtrees.add(first)
            # Nodes whose own checkpoints or children changed, shallowest first (a lost child takes its subtree).
            for key in sorted(changes.nodes & tree.keys(), key=lambda k: tree[k].depth):
                node = tree.get(key)
                if node is None:
                    continue  # it went with an ancestor's lost child
                kids = node.kids
                self._read(state, view, node, node.path(state.root))
                for kid in set(kids).difference(node.kids):
                    dropped += _drop(tree, kid)
                changes.subtrees.update(set(node.kids).difference(kids))
                touched[key] = node
            # Subtrees under a changed kv chunk, shallowest first (one inside another is walked once).
            roots: list[tuple[int, bytes, _Node | None]] = []
            for key in changes.subtrees:
                node = tree.get(key)
                if key == first:
                    roots.append((1, key, None))
                elif node is not None:
                    roots.append((node.depth, key, node.up))
                else:
                    parent = self._parents.get(ChunkKey(pod.namespaces[0], key))
                    up = tree.get(state.node_of(parent.key)) if parent is not None else None
                    if up is not None and key in up.kids:
                        roots.append((up.depth + 1, key, up))
            walked: dict[bytes, _Node] = {}
            for depth, key, up in sorted(roots, key=lambda r: (r[0], r[1])):
                if key in walked:
                    continue
                meta = first_meta if up is None else _listed(view, up.key, key)
                if meta is None:
                    dropped += _drop(tree, key)
                    continue
                before = {node.key: node for node in _preorder(tree, key)}
                walk = self._walk(state, view, tree, key, meta, depth, up)
                walked.update((node.key, node) for node in walk)
                dropped += [node for k, node in before.items() if k not in walked and tree.pop(k, None) is node]
                for node in reversed(walk):  # children first
                    node.advertised = self._flag(view, tree, node)
                touched[key] = walk[0]
            touched.update(walked)
            touched.update((key, tree[key]) for key in changes.adverts if key in tree)
            touched = {key: node for key, node in touched.items() if tree.get(key) is node}
            # A block is advertised iff a restorable checkpoint is at or below it: up from each changed node until
            # a flag stays as it was (deepest first, so that every child's flag is final when its parent's is read).
            for node in sorted(touched.values(), key=lambda n: n.depth, reverse=True):
                node.advertised = self._flag(view, tree, node)
                up = node.up
                while up is not None:
                    flag = self._flag(view, tree, up)
                    if flag == up.advertised:
                        break
                    up.advertised = flag
                    touched[up.key] = up
                    up = up.up
        if not tree:
            del state.trees[first]
        return self._diff(state, view, touched.values(), dropped)

    def _walk(self, state: _PodState, view: "_View", tree: dict[bytes, _Node], key: bytes, meta: ChunkMeta,
              depth: int, up: _Node | None) -> list[_Node]:
        """Recompute the subtree at `key` from the store's directory: its nodes, in pre-order."""
        walk: list[_Node] = []
        stack = [(key, meta, depth, up)]
        while stack:
            key, meta, depth, up = stack.pop()
            node = tree.get(key)
            if node is None:
                node = tree[key] = _Node(key, meta, depth, up)
            else:
                node.meta, node.depth, node.up = meta, depth, up
            self._read(state, view, node, node.path(state.root))
            walk.append(node)
            stack += [(kid, view.meta_of(kid), depth + 1, node) for kid in node.kids]
        return walk

    def _read(self, state: _PodState, view: "_View", node: _Node, path: list[bytes]) -> None:
        """A node's children and restorable checkpoints, from the store."""
        self.work.nodes += 1
        anchor = bytes((ObjectKind.KV, state.anchor))
        children = view.children(node.key)
        node.kids = [child for child, _ in children if child[-2:] == anchor and node.depth < _MAX_DEPTH]
        node.restorable = []
        for position, checkpoint in self._checkpoints(state, node.depth, children):
            self.work.searches += 1
            if _resumes_at(state.pod.shape, path, position, checkpoint, view):
                node.restorable.append((position, checkpoint))

    def _flag(self, view: "_View", tree: dict[bytes, _Node], node: _Node) -> bool:
        """Whether a node is advertised, its children's flags being final."""
        if self._attention_only:  # held in every rank, whatever the checkpoints (published only from the root)
            return view.tier(node.key) is not None
        return bool(node.restorable) or any(tree[kid].advertised for kid in node.kids if kid in tree)

    def _diff(self, state: _PodState, view: "_View", touched, dropped: list[_Node]) -> list[Event]:
        """The new adverts of the touched nodes (in pre-order: a parent's published hash first), and the events that
        turn the old adverts of the touched and dropped nodes into them."""
        orders: dict[int, tuple[bytes, ...]] = {}
        removals: list[tuple[tuple[bytes, ...], int, Event]] = []
        stores: list[tuple[tuple[bytes, ...], int, Event]] = []
        for node in dropped:
            order = _order(node, orders)
            removals += [(order, i, advert.removed()) for i, advert in enumerate(node.adverts.values())]
            _set_block(state, node, {})
        for node in sorted(touched, key=lambda n: _order(n, orders)):
            order = _order(node, orders)
            new = self._adverts(state, view, node)
            old = node.adverts
            for i, (key, advert) in enumerate(old.items()):
                after = new.get(key)
                if after is None or after.stored != advert.stored:
                    removals.append((order, i, advert.removed()))
            for i, (key, advert) in enumerate(new.items()):
                before = old.get(key)
                if before is None or before.stored != advert.stored:
                    stores.append((order, i, advert.stored))
            _set_block(state, node, new)
        # Deepest first: a removal never leaves a child without its parent; parents first: a router knows a block's
        # parent before the block.
        removals.sort(key=lambda r: (r[0], r[1]), reverse=True)
        stores.sort(key=lambda r: (r[0], r[1]))
        return [event for *_, event in removals] + [event for *_, event in stores]

    def _adverts(self, state: _PodState, view: "_View", node: _Node) -> dict[tuple[bytes, int], _Advert]:
        """A node's adverts (its parent's published hash being current), and its own published hash set."""
        pod, shape = state.pod, state.pod.shape
        up, meta = node.up, node.meta
        self.work.adverts += 1
        if not node.advertised or not meta.tokens or (up is not None and up.published is None):
            node.published = None
            return {}
        block_hash = node.published = _published_hash(meta.engine_hash, node.key)
        view.children(node.key)  # the metas of its tails (_mamba)
        parent_hash = up.published if up is not None else None
        tokens = _token_ids(meta.tokens)
        adverts: dict[tuple[bytes, int], _Advert] = {}
        for group in shape.attention:
            where = view.tier(node.key[:16] + bytes((ObjectKind.KV, group)))
            if where is None:
                continue  # a sliding-window chunk out of every hit's window: held or not, nothing to say
            medium, locality = self._medium(pod, where)
            stored = BlockStored((block_hash,), parent_hash, tokens, shape.chunk_tokens, medium,
                                 pod.engine_groups[group], KIND_BY_GROUP[shape.kinds[group]], locality,
                                 shape.windows[group])
            adverts[(node.key, group)] = _Advert(stored)
        for position, checkpoint in node.restorable:
            adverts.update(self._mamba(state, view, checkpoint, position, node.depth, block_hash, parent_hash, meta))
        return adverts

    @staticmethod
    def _checkpoints(state: _PodState, depth: int, children) -> list[tuple[int, bytes]]:
        """(position, chain hash) of the checkpoints to try under a kv node at depth*N, deepest first: where states
        were saved (a tail alone is no checkpoint of a hybrid model); for a model without recurrent groups the
        boundary itself (a tail there adds no block)."""
        shape = state.pod.shape
        if not shape.recurrent:
            return [(depth * shape.chunk_tokens, b"")]
        found = {(meta.prefix_tokens, child[:16]) for child, meta in children if child[-2] == ObjectKind.STATE}
        return sorted(found, reverse=True)

    def _mamba(self, state: _PodState, view: "_View", checkpoint: bytes, position: int, depth: int, block_hash: int,
               parent_hash: int | None, meta: ChunkMeta) -> dict[tuple[bytes, int], _Advert]:
        """The checkpoint's own `mamba` blocks, one per recurrent group: a hash of its own, the block that ends at or
        before it as parent, and the tokens since that block's end (the anchor tail's; none at a boundary). Never
        the attention block's hash or tokens: Dynamo 1.6.1 indexes mamba blocks like attention ones, by their
        tokens, and applies a BlockRemoved to a hash whatever its group, so a checkpoint named or spelled like its
        block would merge with it, and a lost state would take the block with it."""
        pod, shape = state.pod, state.pod.shape
        n = shape.chunk_tokens
        if not shape.recurrent or not checkpoint:
            return {}
        if position == depth * n:
            own, parent, tokens, size = _state_hash(checkpoint), block_hash, (), 0
        else:
            tail = view.meta_of(checkpoint + bytes((ObjectKind.TAIL, state.anchor)))
            if tail is None or not tail.tokens:
                return {}
            own, parent, tokens, size = _published_hash(0, checkpoint), block_hash, _token_ids(tail.tokens), \
                position - depth * n
        adverts = {}
        for group in shape.recurrent:
            where = view.tier(checkpoint + bytes((ObjectKind.STATE, group)))
            if where is None:
                continue
            medium, locality = self._medium(pod, where)
            stored = BlockStored((own,), parent, tokens, size, medium, pod.engine_groups[group], "mamba", locality)
            adverts[(checkpoint, group)] = _Advert(stored)
        return adverts

    def _medium(self, pod: Pod, tier: str) -> tuple[str, str]:
        local = pod.same_node and tier not in self._shared
        return self._medium_override or MEDIUM_BY_TIER.get(tier, "STORAGE"), "LOCAL" if local else "REMOTE"


def _resumes_at(shape: ChainShape, path: list[bytes], p: int, checkpoint: bytes, view: "_View") -> bool:
    """Whether a prompt ending right after position p (its chain `path` down to p's block, `checkpoint` the chain
    hash at p) resumes at p: the Lookup search, asked exactly that."""
    n = shape.chunk_tokens
    positions = {p: checkpoint} if p % n else {}
    return find_hit(Query(shape, p + 1, path[:p // n + 1], positions), view).tokens == p


def _preorder(tree: dict[bytes, _Node], key: bytes) -> list[_Node]:
    """The nodes of the subtree at `key` in the walk's order (children pushed sorted, so the last is visited first)."""
    out: list[_Node] = []
    stack = [key]
    while stack:
        node = tree.get(stack.pop())
        if node is not None:
            out.append(node)
            stack += node.kids
    return out


def _drop(tree: dict[bytes, _Node], key: bytes) -> list[_Node]:
    """Take the subtree at `key` out of the tree; its nodes."""
    nodes = _preorder(tree, key)
    for node in nodes:
        del tree[node.key]
    return nodes


def _order(node: _Node, orders: dict[int, tuple[bytes, ...]]) -> tuple[bytes, ...]:
    """A node's place in the walk's pre-order, as a sortable key: its path of keys from the first chunk, each
    inverted (siblings are visited largest first); `orders` keeps those computed by one diff."""
    chain = []
    while node is not None and id(node) not in orders:
        chain.append(node)
        node = node.up
    order = orders[id(node)] if node is not None else ()
    for node in reversed(chain):
        order = orders[id(node)] = order + (node.key.translate(_INVERT),)
    return order


def _listed(view: "_View", parent: bytes, key: bytes) -> ChunkMeta | None:
    """The meta of `key` if the store lists it among `parent`'s children now."""
    view.children(parent)
    return view.meta_of(key)


def _set_block(state: _PodState, node: _Node, adverts: dict[tuple[bytes, int], _Advert]) -> None:
    """Replace a node's adverts, and its attention block in the pod's blocks by hash (RestorableIndex.tokens_of)."""
    for advert in node.adverts.values():
        if advert.stored.kind != "mamba":
            state.blocks.pop(advert.stored.block_hashes[0], None)
            break
    for advert in adverts.values():
        if advert.stored.kind != "mamba":
            state.blocks[advert.stored.block_hashes[0]] = (advert.stored.parent_block_hash, advert.stored.token_ids)
            break
    node.adverts = adverts


@functools.lru_cache(maxsize=1024)
def _root_hash(namespace: str) -> bytes:
    """h(0) of a namespace (tiercache.prefix.hashes): the parent of every first chunk, never stored."""
    return xxhash.xxh3_128_digest(namespace.encode())


def _published_hash(engine_hash: int, key: bytes) -> int:
    """The engine's hash, or the first 8 bytes of tiercache's chain hash; never 0 (llm-d's "no parent")."""
    value = engine_hash or int.from_bytes(key[:8], "big")
    return value or 1


def _state_hash(checkpoint: bytes) -> int:
    """The published hash of a checkpoint at a block boundary: not its block's (see _mamba), never 0."""
    return xxhash.xxh3_64_intdigest(checkpoint + b"state") or 1


def _token_ids(tokens: bytes) -> tuple[int, ...]:
    return tuple(memoryview(tokens).cast("I")) if tokens else ()


class _View:
    """The store as one recompute sees it, over every rank namespace of a pod (tiercache.prefix.lookup.ChainView):
    a key is held when every rank holds it, in the slowest of their tiers; answers are kept for the recompute."""

    def __init__(self, store: TieredStore, namespaces: Sequence[str], levels: dict[str, int],
                 held: dict[ChunkKey, bool]) -> None:
        self._store = store
        self._held = held  # the index's record of what searches saw, written through
        self._namespaces = namespaces
        self._levels = levels
        self._tiers: dict[bytes, str | None] = {}
        self._children: dict[bytes, list[tuple[bytes, ChunkMeta]]] = {}
        self._metas: dict[bytes, ChunkMeta] = {}

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        missing = [k for k in dict.fromkeys(keys) if k not in self._tiers]
        if missing:
            asked = [ChunkKey(self._namespaces[0], k) for k in missing]
            where = self._store.locate(asked)
            self._held.update((key, tier is not None) for key, tier in zip(asked, where))
            for namespace in self._namespaces[1:]:
                asked = [ChunkKey(namespace, k) for k in missing]
                other = self._store.locate(asked)
                self._held.update((key, tier is not None) for key, tier in zip(asked, other))
                where = [None if a is None or b is None else max(a, b, key=self._levels.__getitem__)
                         for a, b in zip(where, other)]
            self._tiers.update(zip(missing, where))
        return [self._tiers[k] for k in keys]

    def tier(self, key: bytes) -> str | None:
        return self.locate([key])[0]

    def children(self, parent: bytes) -> list[tuple[bytes, ChunkMeta]]:
        found = self._children.get(parent)
        if found is None:
            found = self._children[parent] = sorted(
                (key.key, meta) for key, meta in self._store.children(ChunkKey(self._namespaces[0], parent)))
            self._metas.update(found)
        return found

    def meta_of(self, key: bytes) -> ChunkMeta | None:
        """The meta of a child listed by an earlier `children` call."""
        return self._metas.get(key)
