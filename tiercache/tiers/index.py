"""The index of a tier that keeps one (host, GPU, disk): byte accounting, the chain directory, and THE eviction policy.

Every tier with an index evicts through `ChunkIndex.victims`; each eviction costs O(log n) whatever the number of
records (heaps with lazy deletion; a touch pushes a new heap item and the old one is skipped when it surfaces).

Chains. A chunk may name its *parent* (record.encoding.ChunkMeta.parent): the object it extends (tiercache.prefix).
The index keeps, per parent key, the children it holds — the server's directory of checkpoints under a kv chunk —
and evicts with the chain in mind:
1. *Unreachable objects first.* When the store loses a key for good (evicted from its last tier, deleted), its
   descendants here can never be part of a hit again (`orphan`); they go before anything else, oldest first.
2. *A chain shrinks from its deep end.* Only a leaf — an object none of whose children is held here — is evicted;
   a kv chunk therefore outlives every deeper kv, tail and state that needs it, and the first chunk of a prompt,
   shared by all its continuations, goes last. A chunk without a parent is its own chain. Across tiers the same
   holds: a leaf here whose children the store holds in a tier above (`needed_above`: saved or promoted above a
   parent left unread below) is not evicted but counts as used now, and is asked again when it next comes up.
3. When the tier is full, the least recently used leaf goes, whatever its class: a chain nobody reads shrinks, a
   chain being read keeps its depth. (Preferring KV to states here would let every old chain's states pin it while
   the newest prompts' tails went.)

Recurrent states also keep their own byte budget; when it is full, the state with the lowest value goes (among leaf
states). The value is GreedyDual-Size-Frequency — the recency-and-value score of Marconi (MLSys 2025) without its
normalisation:

    H = L + ((1 + hits) * tokens saved per KiB held) ** w

where L (the inflation) is the H of the last state evicted by value, hits counts reads (a branch point is read by
every branch), and w is `state_value_weight`. A state's score depends on itself and L only — no state is scored
against the best one in the tier, so one 256K-token state cannot flatten the differences between chat states; it
only outlives them without reads for a while, until L passes its H. The score is scale-free (multiplying every value
by c multiplies H and L by c), and w = 0 gives plain LRU. See Cao and Irani, "Cost-aware WWW proxy caching
algorithms" (GDS), and Pan et al., "Marconi: Prefix caching for the era of hybrid LLMs" (MLSys 2025).

Every eviction costs O(log n) whatever the number of records: two heaps (leaves by recency; leaf states by value)
with lazy deletion — a touch pushes a new item, and an item whose node has moved on is skipped when it surfaces.

Not thread-safe: each tier guards its index with its own metadata lock.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

from tiercache.record.encoding import CLASS_STATE, ChunkMeta
from tiercache.record.keys import ChunkKey


class Entry(Protocol):
    record_bytes: int
    meta: ChunkMeta


E = TypeVar("E", bound=Entry)


@dataclass(slots=True)
class _Node(Generic[E]):
    entry: E
    parent: ChunkKey | None
    is_state: bool
    stamp: int = 0  # recency: the clock at its last insert or read
    value: float = 0.0  # H, for states (see the module docstring)
    seq: int = -1  # its live item in the recency heap; -1: none (not an evictable leaf)
    value_seq: int = -1  # its live item in the value heap (states only)
    hits: int = 0
    children: int = 0  # children held in this index
    orphan: bool = False

    @property
    def leaf(self) -> bool:
        return not self.children and not self.orphan


@dataclass(frozen=True, slots=True)
class Victim(Generic[E]):
    key: ChunkKey
    entry: E
    reachable: bool  # False: an orphan, worth nothing below either


_HeapItem = tuple[float, int, ChunkKey]


def parent_of(key: ChunkKey, meta: ChunkMeta) -> ChunkKey | None:
    return ChunkKey(key.namespace, meta.parent) if meta.parent else None


class ChunkIndex(Generic[E]):
    def __init__(self, state_value_weight: float = 0.5) -> None:
        self._nodes: dict[ChunkKey, _Node[E]] = {}
        self._children: dict[ChunkKey, set[ChunkKey]] = {}  # parent key (held or not) -> children held
        self._by_recency: list[_HeapItem] = []  # leaves
        self._by_value: list[_HeapItem] = []  # leaf states
        self._orphans: dict[bool, dict[ChunkKey, None]] = {False: {}, True: {}}  # by is_state, oldest first
        self._clock = itertools.count()
        self._inflation = 0.0  # L
        self._weight = state_value_weight
        self.used_bytes = 0
        self.state_bytes = 0
        self.state_chunks = 0
        self.state_reserved = 0  # state bytes of puts between their reservation and their commit
        self.bytes_by_namespace: dict[str, int] = {}
        self.chunks_by_namespace: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._nodes

    def items(self) -> list[tuple[ChunkKey, E]]:
        return [(key, node.entry) for key, node in self._nodes.items()]

    # -- membership ---------------------------------------------------------------------------------------------

    def add(self, key: ChunkKey, entry: E) -> None:
        """Insert as most recently used. The key must not be present (remove it first)."""
        assert key not in self._nodes, key
        parent = parent_of(key, entry.meta)
        node = _Node(entry, parent, entry.meta.object_class == CLASS_STATE, stamp=next(self._clock))
        self._nodes[key] = node
        self._account(key.namespace, entry, 1)
        children = self._children.get(key)
        if children:  # held children came first (demoted before their parent, say)
            node.children = len(children)
            self._adopt(children)
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
            above = self._nodes.get(parent)
            if above is not None:
                above.children += 1
                above.seq = above.value_seq = -1  # no longer a leaf: its heap items go stale
                node.orphan = above.orphan
        if node.orphan:
            self._orphans[node.is_state][key] = None
        self._push(key, node)

    def remove(self, key: ChunkKey) -> E | None:
        node = self._nodes.pop(key, None)
        if node is None:
            return None
        self._account(key.namespace, node.entry, -1)
        self._orphans[node.is_state].pop(key, None)
        node.seq = node.value_seq = -1
        if node.parent is not None:
            siblings = self._children.get(node.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[node.parent]
            above = self._nodes.get(node.parent)
            if above is not None:
                above.children -= 1
                self._push(node.parent, above)  # a leaf again (if so), with the recency it had
        return node.entry

    def touch(self, key: ChunkKey) -> E | None:
        """The entry, now marked most recently used (and, for a state, read once more)."""
        node = self._nodes.get(key)
        if node is None:
            return None
        node.hits += 1
        node.stamp = next(self._clock)
        node.seq = node.value_seq = -1
        self._push(key, node)
        return node.entry

    def children(self, parent: ChunkKey) -> list[tuple[ChunkKey, E]]:
        """The entries held here whose parent is `parent` (the directory of checkpoints under a chunk)."""
        return [(key, self._nodes[key].entry) for key in self._children.get(parent, ())]

    def orphan(self, parent: ChunkKey) -> int:
        """`parent` is gone from the store: its descendants held here become unreachable. Returns how many."""
        marked = 0
        stack = list(self._children.get(parent, ()))
        while stack:
            key = stack.pop()
            node = self._nodes[key]
            if node.orphan:
                continue
            node.orphan, node.seq, node.value_seq = True, -1, -1
            self._orphans[node.is_state][key] = None
            marked += 1
            stack.extend(self._children.get(key, ()))
        return marked

    # -- eviction -----------------------------------------------------------------------------------------------

    def victims(self, units_over: int, state_over: int, units: Callable[[E], int] = lambda e: e.record_bytes,
                evictable: Callable[[E], bool] = lambda e: True, keep: ChunkKey | None = None,
                needed_above: Callable[[ChunkKey], bool] = lambda key: False) -> list[Victim[E]]:
        """Remove and return entries, in eviction order, until `state_over` state bytes and `units_over` units of the
        tier's room (bytes, pages) are freed — or nothing evictable is left. States over their budget go first
        (unreachable ones, then by value); then unreachable objects, then leaves by recency.

        `keep` — the parent of the record being made room for — is never chosen: evicting a chunk to make room for
        the object that extends it would leave that object unreachable. (When nothing else can go, the tier refuses
        the deeper object instead, and the store tries the tier below.) Nor is a leaf whose children a tier above
        holds (`needed_above`): it is marked used now instead, so each such leaf is asked once per pass of the
        recency order, not on every eviction."""
        chosen: list[Victim[E]] = []
        held: list[tuple[ChunkKey, _Node[E]]] = []  # not evictable right now (pinned, kept): back in place afterwards

        def allowed(key: ChunkKey, node: _Node[E], leaf: bool = False) -> bool:
            if key != keep and evictable(node.entry):
                if not (leaf and needed_above(key)):
                    return True
                node.stamp = next(self._clock)  # as recent as the children above that need it
            held.append((key, node))
            return False

        while state_over > 0:
            victim = self._take_orphan(True, allowed) or self._take_leaf(self._by_value, "value_seq", allowed)
            if victim is None:
                break
            chosen.append(victim)
            state_over -= victim.entry.record_bytes
            units_over -= units(victim.entry)
        while units_over > 0:
            victim = (self._take_orphan(False, allowed) or self._take_orphan(True, allowed)
                      or self._take_leaf(self._by_recency, "seq", allowed))
            if victim is None:
                break
            chosen.append(victim)
            units_over -= units(victim.entry)
        for key, node in held:
            if key in self._nodes:
                if node.orphan:
                    self._orphans[node.is_state][key] = None
                self._push(key, node)
        return chosen

    def state_excess(self, incoming: int, budget: int) -> int:
        """State bytes over `budget` once `incoming` more are added (reservations in flight included)."""
        return self.state_bytes + self.state_reserved + incoming - budget

    def _take_orphan(self, states: bool, allowed: Callable[[ChunkKey, _Node[E]], bool]) -> Victim[E] | None:
        orphans = self._orphans[states]
        while orphans:
            key = next(iter(orphans))
            del orphans[key]
            node = self._nodes[key]
            if allowed(key, node):
                self.remove(key)
                return Victim(key, node.entry, reachable=False)
        return None

    def _take_leaf(self, heap: list[_HeapItem], field: str,
                   allowed: Callable[[ChunkKey, _Node[E]], bool]) -> Victim[E] | None:
        while heap:
            priority, seq, key = heapq.heappop(heap)
            node = self._nodes.get(key)
            if node is None or getattr(node, field) != seq:
                continue  # stale: read, removed, orphaned or no longer a leaf since it was pushed
            node.seq = node.value_seq = -1
            if not allowed(key, node, leaf=True):
                continue
            if heap is self._by_value:
                self._inflation = max(self._inflation, priority)
            self.remove(key)
            return Victim(key, node.entry, reachable=True)
        return None

    def _push(self, key: ChunkKey, node: _Node[E]) -> None:
        """Put a leaf in the heaps it belongs to (no-op for anything else or when already there)."""
        if not node.leaf:
            return
        if node.seq < 0:
            node.seq = next(self._clock)
            heapq.heappush(self._by_recency, (float(node.stamp), node.seq, key))
        if node.is_state and node.value_seq < 0:
            node.value = self._state_value(node)
            node.value_seq = next(self._clock)
            heapq.heappush(self._by_value, (node.value, node.value_seq, key))
        if len(self._by_recency) + len(self._by_value) > 3 * len(self._nodes) + 64:
            self._rebuild()  # mostly stale items: rebuild from the live leaves, O(1) amortised

    def _state_value(self, node: _Node[E]) -> float:
        """H = L + ((1 + hits) * tokens saved per KiB) ** w (see the module docstring)."""
        per_kib = node.entry.meta.prefix_tokens * 1024 / max(node.entry.record_bytes, 1)
        return self._inflation + ((1 + node.hits) * per_kib) ** self._weight

    def _rebuild(self) -> None:
        live = [(key, node) for key, node in self._nodes.items()]
        self._by_recency = [(float(n.stamp), n.seq, k) for k, n in live if n.seq >= 0]
        self._by_value = [(n.value, n.value_seq, k) for k, n in live if n.value_seq >= 0]
        heapq.heapify(self._by_recency)
        heapq.heapify(self._by_value)

    def _adopt(self, children: set[ChunkKey]) -> None:
        """A parent is held again: what descends from it is reachable again if it had been lost."""
        stack = list(children)
        while stack:
            key = stack.pop()
            node = self._nodes[key]
            if node.orphan:
                node.orphan = False
                self._orphans[node.is_state].pop(key, None)
                stack.extend(self._children.get(key, ()))
                self._push(key, node)

    def _account(self, namespace: str, entry: E, count: int) -> None:
        size = entry.record_bytes * count
        self.used_bytes += size
        if entry.meta.object_class == CLASS_STATE:
            self.state_bytes += size
            self.state_chunks += count
        total = self.bytes_by_namespace.get(namespace, 0) + size
        chunks = self.chunks_by_namespace.get(namespace, 0) + count
        if chunks:
            self.bytes_by_namespace[namespace] = total
            self.chunks_by_namespace[namespace] = chunks
        else:
            self.bytes_by_namespace.pop(namespace, None)
            self.chunks_by_namespace.pop(namespace, None)

    def check(self) -> None:
        """Integrity: totals, the parent/child links, and every node in exactly the structures its status says."""
        entries = [node.entry for node in self._nodes.values()]
        assert sum(e.record_bytes for e in entries) == self.used_bytes
        assert sum(n.entry.record_bytes for n in self._nodes.values() if n.is_state) == self.state_bytes
        assert sum(n.is_state for n in self._nodes.values()) == self.state_chunks
        assert sum(self.bytes_by_namespace.values()) == self.used_bytes
        assert sum(self.chunks_by_namespace.values()) == len(entries)
        recency = {(seq, key) for _, seq, key in self._by_recency}
        value = {(seq, key) for _, seq, key in self._by_value}
        for key, node in self._nodes.items():
            assert node.is_state == (node.entry.meta.object_class == CLASS_STATE)
            assert node.children == len(self._children.get(key, ())), key
            if node.parent is not None:
                assert key in self._children[node.parent]
            assert (key in self._orphans[node.is_state]) == node.orphan, key
            assert (node.seq >= 0) == node.leaf and (node.seq < 0 or (node.seq, key) in recency), key
            assert (node.value_seq >= 0) == (node.leaf and node.is_state), key
            assert node.value_seq < 0 or (node.value_seq, key) in value, key
        for parent, children in self._children.items():
            assert children and all(self._nodes[c].parent == parent for c in children)
