"""A router's prefix index following llm-d's rules (llm-d/llm-d-router `pkg/kvevents`, read at ebab687), in Python:
what a KV-aware router that reads a pod's vLLM-format KV events knows of it.

It reads what llm-d's kvevents pool reads and keeps what it keeps:
- a batch `[ts, events, dp_rank]` whose events are maps tagged with "type" (vLLM >= #42892) or positional arrays
  `[tag, field, ...]` (older vLLMs), mapped to one field order (`vllm_adapter.go` `blockStoredFieldOrder`); a batch
  with an event it cannot decode is dropped whole, as `ParseMessage` does;
- the pod and the model from the topic `kv@<pod>@<model>` (`common.go` `parseTopic`); a lora_name is the model;
- BlockStored of kinds full_attention, mla_attention, sink_full_attention, or without group_idx (legacy); every other
  kind is skipped (`pool.go` `isPrefixIndexableSpecKind`), and so is an event whose tokens are not exactly
  `len(block_hashes) * block_size` (`blockStoredEventDigestible`: "non_dense_block_span");
- a parent hash other than 0 must resolve to a request key (the engine key's last one), else the whole event is
  dropped; 0 (or None) is "no parent";
- request keys recomputed from token_ids at the canonical block size (llm-d's token processor, default 16), chained
  from the parent's request key; the model name seeds the chain's root. Engine keys map to request keys 1:1, 1:many
  or many:1 by the ratio of their counts (`Index.Add`). Keys are this module's own (xxh64): llm-d's exact bytes do not
  matter, the structure does;
- removals refcounted per (pod, medium, group) (`event_dedup_filter.go`): a hash is evicted only when no store still
  references it; a BlockRemoved of a group whose kind no store taught the pod's group catalog is skipped
  ("unknown_group"); AllBlocksCleared clears the pod on every tier (`clearPod`);
- scoring as llm-d's LongestPrefixScorer (`kvblock_scorer.go`): the prompt's keys from the first one, keeping the pods
  present at every key so far; each key adds the pod's highest tier weight there (gpu 1.0, cpu 0.8, any other 1.0:
  `DefaultKVCacheBackendConfig`). `score` also gives the plain matched token count per pod.

The sequence rules of llm-d's ZMQ subscriber (replay on connect, gaps, resets) are in `Source`; a subscriber on
real sockets that feeds this index is testkit/llmd_subscriber.py.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence as Seq


import msgpack
import xxhash

CANONICAL_BLOCK_SIZE = 16  # llm-d's token processor's BlockSizeTokens default
DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # DefaultKVCacheBackendConfig; any other tier weighs OTHER_WEIGHT
OTHER_WEIGHT = 1.0
INDEXABLE_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
BLOCK_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
NO_GROUP = -1


class UndecodableBatch(ValueError):
    """A payload llm-d's adapter would refuse (then it drops the whole batch)."""


def parse_topic(topic: str | bytes) -> tuple[str, str]:
    """(pod, model) from `kv@<pod>@<model>`; any other topic is the pod, with no model (llm-d's parseTopic)."""
    if isinstance(topic, bytes):
        topic = topic.decode()
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def _hash(raw) -> int:
    """An engine hash as an unsigned 64-bit key: ints as they are, bytes by their last 8 (getHashAsUint64)."""
    if isinstance(raw, bool) or raw is None:
        raise UndecodableBatch(f"not a block hash: {raw!r}")
    if isinstance(raw, int):
        return raw & (2**64 - 1)
    if isinstance(raw, (bytes, bytearray)) and raw:
        return int.from_bytes(bytes(raw[-8:]), "big")
    raise UndecodableBatch(f"not a block hash: {raw!r}")


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[int, ...]
    parent: int  # 0: none
    tokens: tuple[int, ...]
    block_size: int
    medium: str  # lower-cased; "gpu" when the event says none
    lora_name: str | None
    group_idx: int | None
    kind: str | None


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[int, ...]
    medium: str
    group_idx: int | None


@dataclass(frozen=True)
class Cleared:
    pass


def _tier(medium) -> str:
    if medium is not None and not isinstance(medium, str):
        raise UndecodableBatch(f"medium is not a string: {medium!r}")
    return medium.lower() if medium else "gpu"


def _fields(event) -> list:
    """An event as llm-d's converters see it: [tag, field, ...] in vLLM's positional order."""
    if isinstance(event, dict):
        tag = event.get("type")
        if not isinstance(tag, str):
            raise UndecodableBatch("a map-encoded event without a string 'type'")
        order = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": BLOCK_REMOVED_FIELDS}.get(tag, ())
        return [tag, *(event.get(name) for name in order)]
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        return list(event)
    raise UndecodableBatch(f"malformed tagged union: {event!r:.80}")


def _at(fields: list, i: int):
    return fields[i] if i < len(fields) else None


def decode_event(event) -> Stored | Removed | Cleared:
    fields = _fields(event)
    tag = fields[0]
    if tag == "BlockStored":
        if len(fields) < 5 or not isinstance(fields[1], (list, tuple)) or not isinstance(fields[3], (list, tuple)):
            raise UndecodableBatch("BlockStored: need block_hashes, parent, token_ids, block_size")
        group = _at(fields, 9)
        if group is not None and (not isinstance(group, int) or group < 0):
            raise UndecodableBatch(f"BlockStored: group_idx {group!r}")
        return Stored(tuple(_hash(h) for h in fields[1]), 0 if fields[2] is None else _hash(fields[2]),
                      tuple(int(t) for t in fields[3]), int(fields[4]), _tier(_at(fields, 6)), _at(fields, 7),
                      group, _at(fields, 10))
    if tag == "BlockRemoved":
        if len(fields) < 2 or not isinstance(fields[1], (list, tuple)):
            raise UndecodableBatch("BlockRemoved: need block_hashes")
        return Removed(tuple(_hash(h) for h in fields[1]), _tier(_at(fields, 2)), _at(fields, 3))
    if tag == "AllBlocksCleared":
        return Cleared()
    raise UndecodableBatch(f"unknown vLLM event tag: {tag}")


def decode_batch(payload: bytes) -> list[Stored | Removed | Cleared]:
    """A batch's events; UndecodableBatch for anything llm-d's adapter refuses (the whole batch)."""
    try:
        batch = msgpack.unpackb(payload, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types; all mean "not a batch"
        raise UndecodableBatch(f"not msgpack: {exc}") from exc
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise UndecodableBatch("a batch is [ts, events, dp_rank]")
    return [decode_event(event) for event in batch[1]]


@dataclass
class _Pod:
    groups: dict[int, str] = field(default_factory=dict)  # the group catalog: group_idx -> kind, learned from stores
    refs: Counter = field(default_factory=Counter)  # (tier, group, engine hash) -> outstanding stores


class LlmdIndex:
    """The index: request key -> {(pod, tier, group)}, engine key -> its request keys, per-pod dedup refcounts."""

    def __init__(self, block_size: int = CANONICAL_BLOCK_SIZE, weights: dict[str, float] | None = None) -> None:
        self.block_size = block_size
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self.holders: dict[int, set[tuple[str, str, int]]] = {}  # request key -> (pod, tier, group)
        self.engine_keys: dict[int, tuple[int, ...]] = {}  # engine key -> request keys
        self.pods: dict[str, _Pod] = {}
        self.skipped: Counter = Counter()  # reason -> events (or batches) skipped

    # -- events -----------------------------------------------------------------------------------------------------

    def apply(self, topic: str | bytes, payload: bytes) -> bool:
        """One batch from a pod's stream (topic `kv@<pod>@<model>`); False when the batch was dropped undecoded."""
        pod, model = parse_topic(topic)
        try:
            events = decode_batch(payload)
        except UndecodableBatch:
            self.skipped["undecodable_batch"] += 1
            return False
        self.apply_events(pod, model, events)
        return True

    def apply_events(self, pod: str, model: str, events: Iterable[Stored | Removed | Cleared]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self._store(pod, model, event)
            elif isinstance(event, Removed):
                self._remove(pod, event)
            else:
                self.clear_pod(pod)

    def clear_pod(self, pod: str) -> None:
        """AllBlocksCleared (or a source reset): the pod leaves every key, on every tier; its refcounts go."""
        for key in [k for k, holders in self.holders.items() if any(h[0] == pod for h in holders)]:
            self._drop(key, lambda h: h[0] == pod)
        state = self.pods.get(pod)
        if state is not None:
            state.refs.clear()

    def _store(self, pod: str, model: str, event: Stored) -> None:
        state = self.pods.setdefault(pod, _Pod())
        group = NO_GROUP if event.group_idx is None else event.group_idx
        if event.group_idx is not None and event.kind:
            state.groups[event.group_idx] = event.kind  # the catalog learns from every store, indexable or not
        kind = event.kind or (state.groups.get(event.group_idx) if event.group_idx is not None else None)
        if event.group_idx is not None:
            if kind not in INDEXABLE_KINDS:
                self.skipped["unsupported_cache_kind"] += 1
                return
            if event.tokens and (event.block_size <= 0 or len(event.tokens) % event.block_size
                                 or len(event.tokens) // event.block_size != len(event.block_hashes)):
                self.skipped["non_dense_block_span"] += 1
                return
        parent_key = None
        if event.parent:
            keys = self.engine_keys.get(event.parent)
            if not keys:
                self.skipped["unresolved_parent"] += 1  # the whole event goes
                return
            parent_key = keys[-1]
        request_keys = self.request_keys(event.tokens, event.lora_name or model, parent_key)
        if not request_keys:
            self.skipped["no_full_canonical_block"] += 1  # (llm-d: a device-tier update; tiercache sends tokens)
            return
        self._add(event.block_hashes, request_keys, (pod, event.medium, group))
        for h in event.block_hashes:
            state.refs[(event.medium, group, h)] += 1

    def _add(self, engine: Seq[int], request: Seq[int], holder: tuple[str, str, int]) -> None:
        """Index.Add: engine keys to request keys by the ratio of their counts (1:1, 1:many, many:1)."""
        e, r = len(engine), len(request)
        for i, h in enumerate(engine):
            if e <= r:
                mine = tuple(request[i * r // e:(i + 1) * r // e])
            else:
                mine = (request[i * r // e],)
            self.engine_keys[h] = mine
        for key in request:
            self.holders.setdefault(key, set()).add(holder)

    def _remove(self, pod: str, event: Removed) -> None:
        state = self.pods.get(pod)
        group = NO_GROUP if event.group_idx is None else event.group_idx
        if event.group_idx is not None:
            kind = state.groups.get(event.group_idx) if state is not None else None
            if kind is None:
                self.skipped["unknown_group"] += 1
                return
            if kind not in INDEXABLE_KINDS:
                self.skipped["unsupported_cache_kind"] += 1
                return
        holder = (pod, event.medium, group)
        for h in event.block_hashes:
            if state is not None:
                ref = (event.medium, group, h)
                count = state.refs.get(ref, 0)
                if count > 1:
                    state.refs[ref] = count - 1
                    self.skipped["suppressed_duplicate_removal"] += 1
                    continue
                state.refs.pop(ref, None)
            for key in self.engine_keys.get(h, ()):
                self._drop(key, lambda x: x == holder)

    def _drop(self, key: int, which) -> None:
        holders = self.holders.get(key)
        if holders is None:
            return
        holders -= {h for h in holders if which(h)}
        if not holders:
            del self.holders[key]

    # -- keys and scores --------------------------------------------------------------------------------------------

    def request_keys(self, tokens: Seq[int], model: str, parent: int | None = None) -> list[int]:
        """The request keys of `tokens`' full canonical blocks, chained from `parent` (None: the model's root)."""
        key = parent if parent is not None else xxhash.xxh64_intdigest(model.encode())
        keys = []
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = b"".join(int(t).to_bytes(4, "little") for t in tokens[start:start + size])
            key = xxhash.xxh64_intdigest(key.to_bytes(8, "little") + block)
            keys.append(key)
        return keys

    def score(self, tokens: Seq[int], model: str, pods: Iterable[str] | None = None) -> dict[str, tuple[int, float]]:
        """{pod: (matched tokens, weighted score)} for the pods holding the prompt's first key (LongestPrefixScorer);
        `pods` limits the answer to those (llm-d's podIdentifiers)."""
        wanted = None if pods is None else set(pods)
        scores: dict[str, list] = {}
        alive: set[str] | None = None
        for key in self.request_keys(tokens, model):
            best: dict[str, float] = {}
            for pod, tier, _ in self.holders.get(key, ()):
                if (wanted is None or pod in wanted) and (alive is None or pod in alive):
                    best[pod] = max(best.get(pod, 0.0), self.weights.get(tier, OTHER_WEIGHT))
            if not best:
                break
            alive = set(best)
            for pod, weight in best.items():
                entry = scores.setdefault(pod, [0, 0.0])
                entry[0] += self.block_size
                entry[1] += weight
        return {pod: (matched, weighted) for pod, (matched, weighted) in scores.items()}

    def matched_tokens(self, tokens: Seq[int], model: str, pod: str) -> int:
        return self.score(tokens, model, [pod]).get(pod, (0, 0.0))[0]


class Source:
    """llm-d's ZMQ subscriber's sequence rules for one source with a replay endpoint (`zmq_subscriber.go`
    runSubscriber / requestReplay), over callables instead of sockets: `deliver(seq, message)` hands a batch to the
    index, `replay(start)` asks the source's ROUTER and returns its frames [(seq, message)] up to the end marker (None
    when it failed), `reset()` clears what the source said (the pod). A replay whose frames are not consecutive from
    its start, or that brings nothing for a start > 0, resets the source and starts a cooldown during which gaps are
    not repaired (llm-d: 30 s)."""

    def __init__(self, deliver: Callable[[int, object], None], replay: Callable[[int], list | None],
                 reset: Callable[[], None], cooldown_s: float = 30.0) -> None:
        self._deliver, self._replay, self._reset = deliver, replay, reset
        self.cooldown_s = cooldown_s
        self.last: int | None = None  # the last seq given to the index (live or replayed)
        self.last_live: int | None = None
        self.failed_at: float | None = None
        self.resets = 0
        self.replays = 0

    def connect(self) -> None:
        """The proactive replay from 0 on connect."""
        if self.last is None and self._may_replay():
            self._request(0)

    def live(self, seq: int, message: object) -> None:
        attempted = False
        if self.last_live is not None and seq < self.last_live:  # the publisher restarted: rebuild
            self._reset()
            self.resets += 1
            self.last, self.failed_at, attempted = None, None, True
            self._request(0)
        if self.last_live is not None and seq == self.last_live:
            return
        self.last_live = seq
        if self.last is not None and seq <= self.last:
            return
        if self.last is not None and seq > self.last + 1:
            if not self._may_replay():
                return
            attempted = True
            if not self._request(self.last + 1):
                return
        if self.last is None and seq > 0:
            if attempted or not self._may_replay() or not self._request(0):
                return
        if self.last is not None and seq != self.last + 1:
            return
        self._deliver(seq, message)
        self.last = seq

    def _may_replay(self) -> bool:
        return self.failed_at is None or time.monotonic() - self.failed_at >= self.cooldown_s

    def _request(self, start: int) -> bool:
        self.replays += 1
        frames = self._replay(start)
        if frames is None:
            return False
        expected = start
        for seq, message in frames:
            if seq != expected:  # "incomplete replay": what came is kept, the source starts over
                return self._invalidate()
            self._deliver(seq, message)
            self.last = seq
            expected += 1
        if not frames and start > 0:
            return self._invalidate()
        return True

    def _invalidate(self) -> bool:
        self._reset()
        self.resets += 1
        self.last = None
        self.failed_at = time.monotonic()
        return False
