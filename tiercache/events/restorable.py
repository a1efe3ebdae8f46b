"""The restorable index: which attention blocks each pod can restore from this server, as vLLM-style block events.

A router (llm-d, Dynamo) counts a pod's cached attention blocks from the start of a prompt. For a hybrid model an
attention block is worth nothing without a recurrent checkpoint at or after it, so a block is *advertised* iff a
checkpoint at or after it on its branch satisfies the whole hit rule for the pod: every attention group's kv chain in
every rank namespace, the tail when mid-block, the state when recurrent. That is decided by the very search behind
the Lookup call (tiercache.prefix.lookup.find_hit, asked "does a prompt ending right after checkpoint p resume at
p?"), never by a second hit rule. A pure-attention model has no checkpoints: a block is advertised when its kv chain
is complete (its boundary resumes). Issue 27's memo, B1/B2.

How it stays current. The store tells the index of every change of where a key is held (TieredStore.watch); the
index notes them and, at each `flush`, recomputes the trees the changes touched: a tree is everything under one first
chunk (the anchor group's kv object at N of the pod's first namespace), walked through the store's directory
(children by parent). The new advertised set of a tree is compared with the old one, and the difference becomes
events: BlockStored for a (block, group) that becomes advertised, BlockRemoved for one that stops being so, both
(removed from the old medium, stored in the new) for one whose medium or locality changes. So every transition is
sent exactly once, as llm-d's refcounted removals need. Checkpoints themselves are published as `mamba` blocks
(vLLM's kind for recurrent groups) for routers that learn to read them.

What a block is called: the engine's own block hash and token ids, which connectors send with the anchor group's kv
chunks in rank 0 (ChunkMeta.tokens, engine_hash). Without an engine hash, the first 8 bytes of tiercache's chain
hash stand in (unique within a pod's stream; routers recompute their keys from the tokens anyway). Blocks without
tokens are not advertised: routers cannot key them. Hash 0 is never published (llm-d reads 0 as "no parent").

Not thread-safe by itself beyond `note`: the publisher calls everything else from its one thread.
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
# tiercache is CPU or STORAGE, with the locality as seen from the pod (memo B5).
MEDIUM_BY_TIER = {"gpu": "CPU", "host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}
KIND_BY_GROUP = {GroupKind.FULL_ATTENTION: "full_attention", GroupKind.SLIDING_WINDOW: "sliding_window",
                 GroupKind.RECURRENT: "mamba"}
_KEY_BYTES = 18  # chain hash (16), kind, group: the hybrid connectors' object keys (prefix.objects)
_MAX_DEPTH = 1 << 20


@dataclass(frozen=True)
class Pod:
    """One engine instance as a router sees it: its id and model (llm-d's topic `kv@<pod>@<model>`), its rank
    namespaces (an object counts only when every rank holds its shard; the first rank's kv chunks carry the tokens),
    the layout's shape, vLLM's KV cache group index for each layout group, and whether it runs on this server's node."""

    pod_id: str
    model_name: str
    namespaces: tuple[str, ...]
    shape: ChainShape
    engine_groups: tuple[int, ...]
    dp_rank: int = 0
    same_node: bool = True


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


class _PodState:
    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        anchor = pod.shape.anchor
        self.anchor = anchor
        self.root = object_key(_root_hash(pod.namespaces[0]), ObjectKind.KV, anchor)
        self.trees: dict[bytes, dict[tuple[bytes, int], _Advert]] = {}  # first chunk's key -> adverts, pre-order


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
        self._lock = threading.Lock()  # guards _pending and _watched, which the store's threads write
        self._pending: list[tuple[ChunkKey, ChunkMeta | None]] = []
        self._watched: frozenset[str] = frozenset()
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
            events += self._recompute(state, first)
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
        return [AllBlocksCleared()]

    def pods(self) -> list[Pod]:
        return [state.pod for state in self._pods.values()]

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
        dirty: dict[str, set[bytes]] = {}
        last: dict[ChunkKey, ChunkMeta | None] = {}
        for key, meta in pending:  # first every parent, so that each change below finds its tree
            last[key] = meta
            if meta is not None:
                self._learn(key, meta)
        for key in last:
            for state in self._by_namespace.get(key.namespace, ()):
                first = self._first_of(state, key)
                if first is not None:
                    dirty.setdefault(state.pod.pod_id, set()).add(first)
        # Keys gone for good: their trees are marked, nothing needs their parents any more. (A corrupt copy that was
        # dropped may leave another below: such a key stays known.)
        gone = [key for key, meta in last.items() if meta is None]
        for key, where in zip(gone, self._store.locate(gone) if gone else []):
            if where is None:
                self._parents.pop(key, None)
                self._first_metas.pop(key, None)
        events: dict[str, list[Event]] = {}
        for pod_id, firsts in dirty.items():
            state = self._pods[pod_id]
            out = [event for first in sorted(firsts) for event in self._recompute(state, first)]
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
        return [AllBlocksCleared(), *(advert.stored for tree in state.trees.values() for advert in tree.values())]

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

    def _recompute(self, state: _PodState, first: bytes) -> list[Event]:
        old = state.trees.pop(first, {})
        new = self._advertised(state, first)
        if new:
            state.trees[first] = new
        events: list[Event] = []
        for key in reversed(old):  # deepest first: a removal never leaves a child without its parent
            before, after = old[key], new.get(key)
            if after is None or after.stored != before.stored:
                events.append(before.removed())
        for key, advert in new.items():  # parents first: a router knows a block's parent before the block
            before = old.get(key)
            if before is None or before.stored != advert.stored:
                events.append(advert.stored)
        return events

    def _advertised(self, state: _PodState, first: bytes) -> dict[tuple[bytes, int], _Advert]:
        """The tree's advertised (block, group)s and checkpoints, in pre-order."""
        pod, shape = state.pod, state.pod.shape
        n = shape.chunk_tokens
        view = _View(self._store, pod.namespaces, self._levels)
        first_meta = self._first_metas.get(ChunkKey(pod.namespaces[0], first))
        if first_meta is None:
            return {}
        # Pre-order walk: (key, meta, depth, index of the parent node, path of chain hashes down to it).
        nodes: list[tuple[bytes, ChunkMeta, int, int, list[bytes]]] = []
        stack = [(first, first_meta, 1, -1, [state.root[:16], first[:16]])]
        restorable: list[list[tuple[int, bytes]]] = []  # per node: (position, hash) of its restorable checkpoints
        while stack:
            key, meta, depth, up, path = stack.pop()
            index = len(nodes)
            nodes.append((key, meta, depth, up, path))
            children = view.children(key)
            checkpoints = self._checkpoints(state, depth, children)
            restorable.append([(p, ck) for p, ck in checkpoints if _resumes_at(shape, path, p, ck, view)])
            for child, child_meta in children:
                if child[-2:] == bytes((ObjectKind.KV, state.anchor)) and depth < _MAX_DEPTH:
                    stack.append((child, child_meta, depth + 1, index, path + [child[:16]]))
        advertised = [bool(r) for r in restorable]
        for index in range(len(nodes) - 1, -1, -1):  # a block is advertised when anything under it resumes
            up = nodes[index][3]
            if advertised[index] and up >= 0:
                advertised[up] = True
        if self._attention_only:  # held in every rank, whatever the checkpoints (the parent check below: from root)
            advertised = [view.tier(key) is not None for key, *_ in nodes]
        adverts: dict[tuple[bytes, int], _Advert] = {}
        hashes: dict[int, int] = {}  # node index -> its published hash
        for index, (key, meta, depth, up, path) in enumerate(nodes):
            if not advertised[index] or not meta.tokens or (up >= 0 and up not in hashes):
                continue
            block_hash = hashes[index] = _published_hash(meta.engine_hash, key)
            parent_hash = hashes[up] if up >= 0 else None
            tokens = _token_ids(meta.tokens)
            for group in shape.attention:
                where = view.tier(path[-1] + bytes((ObjectKind.KV, group)))
                if where is None:
                    continue  # a sliding-window chunk out of every hit's window: held or not, nothing to say
                medium, locality = self._medium(pod, where)
                stored = BlockStored((block_hash,), parent_hash, tokens, n, medium, pod.engine_groups[group],
                                     KIND_BY_GROUP[shape.kinds[group]], locality, shape.windows[group])
                adverts[(key, group)] = _Advert(stored)
            for position, checkpoint in restorable[index]:
                adverts.update(self._mamba(state, view, checkpoint, position, depth, block_hash, parent_hash, meta))
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

    def __init__(self, store: TieredStore, namespaces: Sequence[str], levels: dict[str, int]) -> None:
        self._store = store
        self._namespaces = namespaces
        self._levels = levels
        self._tiers: dict[bytes, str | None] = {}
        self._children: dict[bytes, list[tuple[bytes, ChunkMeta]]] = {}
        self._metas: dict[bytes, ChunkMeta] = {}

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        missing = [k for k in dict.fromkeys(keys) if k not in self._tiers]
        if missing:
            where = self._store.locate([ChunkKey(self._namespaces[0], k) for k in missing])
            for namespace in self._namespaces[1:]:
                other = self._store.locate([ChunkKey(namespace, k) for k in missing])
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
