"""The restorable index: which attention blocks each pod can restore from this server, as vLLM-style block events.

A router (llm-d, Dynamo) counts a pod's cached attention blocks from the start of a prompt. For a hybrid model an
attention block is worth nothing without a recurrent checkpoint at or after it, so a block is *advertised* iff a
checkpoint at or after it on its branch satisfies the whole hit rule for the pod: every attention group's kv chain in
every rank namespace, the tail when mid-block, the state when recurrent. That is decided by the very search behind
the Lookup call (tiercache.prefix.lookup.find_hit, asked "does a prompt ending right after checkpoint p resume at
p?", over the Lookup's own view of the store, tiercache.store.chain.StoreChain), never by a second hit rule. A
pure-attention model has no checkpoints: a block is advertised when its kv chain is complete (its boundary resumes).
tests/events/test_restorable.py checks these rules.

How it stays current. The store tells the index of every change of where a key is held (TieredStore.watch); the
index notes them and, at each `flush`, redoes only what those changes can alter (tiercache.events.recompute), in the
block trees it keeps per pod (tiercache.events.tree), read from the store's directory (children by parent). A change
at key X can alter:
- when X was placed or lost: if X is a kv chunk (any group, any rank: the hit rule needs the whole chain), the
  restorable checkpoints of every node whose path holds X's node, so X's node's subtree is read again; if X is a
  tail or a state, the checkpoints of its own node only; and if X is an anchor kv chunk of the first namespace, its
  parent's children (a lost one takes its subtree out of the tree);
- the advertised flag of the ancestors of what was redone (a block is advertised iff a restorable checkpoint is at
  or below it): redone from the node up until a flag stays as it was;
- when X, a kv chunk whose node is in the tree, only moved (every search so far saw it held and it is held now, in
  whatever tier: demoted, promoted, put again), the media of its own node's adverts alone (the hit rule asks whether
  a key is held, never where). A tail or state is always read again with its node (a few searches).
Then the adverts of just those nodes are redone, parents first, and diffed into events (tiercache.events.adverts).
What a flush costs: for a put at a leaf, reading the leaf and its parent (a find_hit per checkpoint there) and a walk
up its path; a chunk placed or lost high in a tree re-reads the subtree below it (as it must: every hit through it
changed). `effort` counts it.

Thread-safety: `note` runs on the store's threads and only queues; every other call takes one lock (`_turn`), so
the publisher's thread (flushes, replays) and RPC threads (pods registering, pod queries by hash) take turns.
"""

from __future__ import annotations

import threading
from typing import Sequence

from tiercache.events.blocks import AllBlocksCleared, Event, Pod
from tiercache.events.recompute import Effort, KnownKeys, Recompute
from tiercache.events.tree import MAX_DEPTH, PodTrees, Redo, Tree, preorder
from tiercache.prefix.hashes import root_hash
from tiercache.prefix.objects import ObjectKey, ObjectKind
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore


class RestorableIndex:
    """`advertise="attention"` (events.advertise, for comparisons): every attention block whose kv chain is held
    from the root, in every attention group and rank, is advertised, with no regard to checkpoints: what an engine's
    own events say of the blocks it saved. `medium_override`: the medium every block is labelled with instead of its
    tier's (events.medium_override)."""

    def __init__(self, store: TieredStore, advertise: str = "restorable", medium_override: str = "") -> None:
        if advertise not in ("restorable", "attention"):
            raise ValueError(f"advertise must be restorable or attention, not {advertise!r}")
        self._store = store
        self._pods: dict[str, PodTrees] = {}
        self._by_namespace: dict[str, list[PodTrees]] = {}
        self._known = KnownKeys()  # written here only: the recompute reads it
        self._recompute = Recompute(store, self._known, advertise == "attention", medium_override)
        self._lock = threading.Lock()  # guards _pending and _watched, which the store's threads write
        self._pending: list[tuple[ChunkKey, ChunkMeta | None]] = []
        self._watched: frozenset[str] = frozenset()
        self._turn = threading.RLock()  # one pod change, flush or snapshot at a time (RPC threads and the publisher)
        store.watch(self.note)

    @property
    def effort(self) -> Effort:
        return self._recompute.effort

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
        with self._turn:
            self._remove_pod(pod.pod_id)
            trees = PodTrees(pod)
            self._pods[pod.pod_id] = trees
            for namespace in pod.namespaces:
                self._by_namespace.setdefault(namespace, []).append(trees)
            self._watch_namespaces()
            for key, meta in self._store.entries(frozenset(pod.namespaces)):
                self._record(key, meta)
            primary = pod.namespaces[0]
            firsts = {key for key, parent in self._known.parents.items()
                      if key.namespace == primary and parent is not None and parent.key == trees.root_key}
            events: list[Event] = [AllBlocksCleared()]
            for first in sorted(obj.prefix_hash for obj in map(ObjectKey.parse, (k.key for k in firsts))
                                if obj is not None and obj.kind is ObjectKind.KV):
                redo = Redo()
                redo.subtrees.add(first)
                events += self._recompute.redo_tree(trees, first, redo)
            return events

    def remove_pod(self, pod_id: str) -> list[Event]:
        with self._turn:
            return self._remove_pod(pod_id)

    def _remove_pod(self, pod_id: str) -> list[Event]:
        trees = self._pods.pop(pod_id, None)
        if trees is None:
            return []
        for namespace in trees.pod.namespaces:
            pods = self._by_namespace[namespace]
            pods.remove(trees)
            if not pods:
                del self._by_namespace[namespace]
        watched = self._watch_namespaces()
        for known in (self._known.parents, self._known.first_metas, self._known.held):
            for key in [k for k in known if k.namespace not in watched]:
                del known[key]
        return [AllBlocksCleared()]

    def _watch_namespaces(self) -> frozenset[str]:
        with self._lock:
            self._watched = frozenset(self._by_namespace)
            return self._watched

    def pods(self) -> list[Pod]:
        with self._turn:
            return [trees.pod for trees in self._pods.values()]

    def tokens_of(self, pod_id: str, block_hashes: Sequence[int]) -> list[int]:
        """The token ids of the longest leading run of `block_hashes` that the pod advertises as one chain from its
        first block (as its events published them at the last flush); [] for an unknown pod. Read-only."""
        with self._turn:
            trees = self._pods.get(pod_id)
            tokens: list[int] = []
            parent = None
            for block_hash in block_hashes if trees is not None else ():
                block = trees.blocks.get(block_hash)
                if block is None or block[0] != parent:
                    break
                tokens += block[1]
                parent = block_hash
            return tokens

    # -- events -----------------------------------------------------------------------------------------------------

    def flush(self) -> dict[str, list[Event]]:
        """Apply what the store said since the last flush: the events of each pod whose advertised set changed."""
        with self._turn:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return {}
            last: dict[ChunkKey, ChunkMeta | None] = dict(pending)
            moved = self._only_moved(last)
            for key, meta in pending:  # first every parent, so that each change below finds its tree
                if meta is not None:
                    self._record(key, meta)
            dirty: dict[str, dict[bytes, Redo]] = {}
            for key in last:
                for trees in self._by_namespace.get(key.namespace, ()):
                    first = self._first_of(trees, key)
                    if first is not None:
                        redo = dirty.setdefault(trees.pod.pod_id, {}).setdefault(first, Redo())
                        self._note_redo(trees, key, key in moved, redo, trees.trees.get(first, {}))
            self._forget_lost([key for key, meta in last.items() if meta is None])
            events: dict[str, list[Event]] = {}
            for pod_id, redos in dirty.items():
                trees = self._pods[pod_id]
                out = [event for first in sorted(redos)
                       for event in self._recompute.redo_tree(trees, first, redos[first])]
                if out:
                    events[pod_id] = out
            return events

    def _only_moved(self, last: dict[ChunkKey, ChunkMeta | None]) -> set[ChunkKey]:
        """The keys that every search so far saw held and that are held now: they only moved (demoted, promoted, put
        again), and the hit rule asks whether a key is held, never where. (Not "noted as placed before": a key on its
        way down a tier can be missed by a search between its placement's note and its demotion's.)"""
        candidates = [key for key, meta in last.items() if meta is not None and self._known.held.get(key)]
        where = self._store.locate(candidates) if candidates else []
        return {key for key, tier in zip(candidates, where) if tier is not None}

    def _forget_lost(self, lost: list[ChunkKey]) -> None:
        """Keys gone for good: their trees are marked, nothing needs their parents any more. (A corrupt copy that
        was dropped may leave another below: such a key stays known.)"""
        for key, where in zip(lost, self._store.locate(lost) if lost else []):
            if where is None:
                self._known.parents.pop(key, None)
                self._known.first_metas.pop(key, None)
                self._known.held.pop(key, None)

    def snapshot(self, pod_id: str) -> list[Event]:
        """AllBlocksCleared and a BlockStored for everything the pod has advertised (a subscriber's replay)."""
        with self._turn:
            trees = self._pods.get(pod_id)
            if trees is None:
                return [AllBlocksCleared()]
            return [AllBlocksCleared(), *(advert.stored for first, tree in trees.trees.items()
                                          for node in preorder(tree, first) for advert in node.adverts.values())]

    # -- which trees a change touches -------------------------------------------------------------------------------

    def _record(self, key: ChunkKey, meta: ChunkMeta) -> None:
        """A key's parent; and the meta of a first chunk, where a tree's walk starts (the rest it reads from the
        store's directory)."""
        parent = ChunkKey(key.namespace, meta.parent) if meta.parent else None
        self._known.parents[key] = parent
        if parent is None:
            return
        own, up = ObjectKey.parse(key.key), ObjectKey.parse(parent.key)
        if own is not None and up is not None and own.kind is ObjectKind.KV \
                and up.prefix_hash == root_hash(key.namespace):
            self._known.first_metas[key] = meta

    def _first_of(self, trees: PodTrees, key: ChunkKey) -> bytes | None:
        """The chain hash of the first chunk of the tree `key` belongs to, in the pod's first namespace; None when its
        chain does not reach the root (then nothing under it is restorable, and the loss that broke it already marked
        its tree), or when it is no prefix object (an opaque chunk)."""
        own = ObjectKey.parse(key.key)
        if own is not None and own.kind is not ObjectKind.KV:
            parent = self._known.parents.get(key)
            own = ObjectKey.parse(parent.key) if parent is not None else None
        if own is None:
            return None
        node = ChunkKey(trees.pod.namespaces[0], trees.anchor_key(own.prefix_hash))
        for _ in range(MAX_DEPTH):
            if node.key == trees.root_key:
                return None  # a checkpoint before the first boundary: no block is advertised for it
            parent = self._known.parents.get(node)
            if parent is None:
                return None
            if parent.key == trees.root_key:
                return ObjectKey.parse(node.key).prefix_hash
            node = parent
        return None

    def _note_redo(self, trees: PodTrees, key: ChunkKey, moved: bool, redo: Redo, tree: Tree) -> None:
        """Note in `redo` what a change at `key` can alter: a kv chunk placed or lost (any group, any rank) every
        hit through its node, so the node's subtree, or when it only moved and its node is in the tree, the node's
        adverts; a tail or state its own node's checkpoints (cheap: they are read again, moved or not). An anchor
        kv chunk placed or lost in the first namespace also adds or removes a child of its parent node."""
        own = ObjectKey.parse(key.key)
        parent = self._known.parents.get(key)
        up = ObjectKey.parse(parent.key) if parent is not None else None
        if own.kind is ObjectKind.KV and moved and own.prefix_hash in tree:
            redo.adverts.add(own.prefix_hash)
        elif own.kind is ObjectKind.KV:
            redo.subtrees.add(own.prefix_hash)
            if key.namespace == trees.pod.namespaces[0] and own.group == trees.anchor and up is not None \
                    and parent.key != trees.root_key:
                redo.nodes.add(up.prefix_hash)
        elif up is not None:
            redo.nodes.add(up.prefix_hash)
