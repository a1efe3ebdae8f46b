"""A router index that reads tiercache's checkpoint (`mamba`) events besides llm-d's attention index: what a router
that "learns to read them" (docs/events.md, "What is published") knows of where a hybrid model's prompt can resume,
to the token.

llm-d skips `kv_cache_spec_kind="mamba"` events and counts whole attention blocks (testkit/llmd_index.py,
kept here as it is, in `attention`). On a hybrid model that overcounts where a prompt leaves a branch between a block
and the branch's next restorable checkpoint, and it cannot see a hit that ends mid-block (tail + state at a prompt's
end: every short chat turn). tiercache publishes each restorable checkpoint as a BlockStored of kind `mamba` (one per
recurrent group): a hash of its own, as parent the hash of the attention block that ends at or before it, and the
tokens since that block's end (`block_size` < N; none at a boundary) (docs/events.md, tiercache/events/restorable.py
`_mamba`). This index keeps, per checkpoint hash, its parent block's last canonical request key (resolved through
the attention index's engine keys, so a checkpoint is found where the prompt's own keys reach its block) and its
tokens; per (pod, medium, group) who holds it, refcounted like llm-d's removals (a BlockRemoved of a group the pod's
catalog knows as `mamba` names the checkpoint's own hash); AllBlocksCleared clears the pod in both indexes.

A prompt's score on a pod is the deepest of the pod's checkpoints on the prompt's path whose tokens are a prefix of
the prompt's tokens after its block, in tokens, not rounded to blocks; capped so that the engine still computes the
prompt's last token (a checkpoint at most one token before the prompt's end), as Lookup answers a connector. A
checkpoint is on the prompt's path when its block's key is one of the prompt's own request keys: keys are chained, so
that one key matches every token before it. Nothing here is a second hit rule: tiercache advertises only checkpoints
its Lookup resumes at (their blocks with them), and the router only finds them in a prompt.

Why the path is not walked through llm-d's holders (LongestPrefixScorer's walk): the llm-d-rules index drops a pod
from every request key of a removed engine block (llmd_index.py `_remove`), also from keys that other blocks of the
pod still hold. With N = 560 (35 keys a block) every conversation's first block shares the 32 keys of the trace's
512-token system prompt, so once one first block of a pod is evicted the walk stops at key 0 for that pod, though
the pod can still restore thousands of tokens of the prompt (`lab/fleet_trace.py --diagnose` records, per
request, what the router believed of each pod beside what the pod could restore; docs/benchmarks.md,
"lab.fleet_trace"). A checkpoint is withdrawn when it stops being restorable, so its own key is the path's proof.

Keys are matched at an attention block's end, so N must be a multiple of the canonical block size (16), as llm-d's
keys of consecutive blocks need too. A pod whose events carry no checkpoints (an attention-only model) scores 0
here: read its attention count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence as Seq

from testkit.llmd_index import (OTHER_WEIGHT, Cleared, LlmdIndex, Removed, Stored, UndecodableBatch, decode_batch,
                                parse_topic)

CHECKPOINT_KIND = "mamba"  # vLLM's kind for recurrent groups; tiercache's kind for its checkpoints


@dataclass(frozen=True)
class Checkpoint:
    """A restorable checkpoint as its event names it: the request key at its block's end, and the tokens since."""

    block_key: int
    tokens: tuple[int, ...]


@dataclass
class _Pod:
    refs: Counter = field(default_factory=Counter)  # (medium, group, checkpoint hash) -> outstanding stores


class CheckpointIndex:
    """llm-d's attention index (`attention`, unchanged) and each pod's restorable checkpoints, from the same stream.
    `apply` / `apply_events` / `clear_pod` as LlmdIndex's (a Feeds can drive it); `score` answers in tokens."""

    def __init__(self, attention: LlmdIndex | None = None) -> None:
        self.attention = attention if attention is not None else LlmdIndex()
        self.checkpoints: dict[int, Checkpoint] = {}  # checkpoint hash -> where it is
        self.at_block: dict[int, dict[int, set[tuple[str, str, int]]]] = {}  # block key -> hash -> (pod, tier, group)
        self.pods: dict[str, _Pod] = {}
        self.skipped: Counter = Counter()  # mamba events this index could not place, by reason

    # -- events -----------------------------------------------------------------------------------------------------

    def apply(self, topic: str | bytes, payload: bytes) -> bool:
        pod, model = parse_topic(topic)
        try:
            events = decode_batch(payload)
        except UndecodableBatch:
            self.attention.skipped["undecodable_batch"] += 1  # dropped whole by both, as llm-d drops it
            return False
        self.apply_events(pod, model, events)
        return True

    def apply_events(self, pod: str, model: str, events: Iterable[Stored | Removed | Cleared]) -> None:
        """Every event goes to the attention index as it is (it skips the mamba ones, learning their groups into the
        pod's catalog); the checkpoints' own are kept here. In order: a checkpoint's parent block comes before it."""
        for event in events:
            if isinstance(event, Cleared):
                self.clear_pod(pod)
                continue
            is_checkpoint = self._is_checkpoint(pod, event)  # before the catalog learns: a removal's group is known
            self.attention.apply_events(pod, model, [event])
            if is_checkpoint and isinstance(event, Stored):
                self._store(pod, event)
            elif is_checkpoint:
                self._remove(pod, event)

    def _is_checkpoint(self, pod: str, event: Stored | Removed) -> bool:
        if event.group_idx is None:
            return False  # legacy events have no group: attention blocks
        state = self.attention.pods.get(pod)
        known = state.groups.get(event.group_idx) if state is not None else None
        kind = (event.kind or known) if isinstance(event, Stored) else known  # a store without a kind: its group's
        return kind == CHECKPOINT_KIND

    def clear_pod(self, pod: str) -> None:
        self.attention.clear_pod(pod)
        for key in list(self.at_block):
            self._drop(key, lambda h: h[0] == pod)
        self.pods.pop(pod, None)

    def _store(self, pod: str, event: Stored) -> None:
        if len(event.tokens) != event.block_size or len(event.block_hashes) != 1:
            self.skipped["malformed_checkpoint"] += 1  # tiercache sends one checkpoint an event, dense
            return
        block_keys = self.attention.engine_keys.get(event.parent) if event.parent else None
        if not block_keys:
            self.skipped["unresolved_parent"] += 1  # its block was never indexed: no prompt can reach it here
            return
        (own,) = event.block_hashes
        self.checkpoints[own] = Checkpoint(block_keys[-1], event.tokens)
        self.at_block.setdefault(block_keys[-1], {}).setdefault(own, set()).add((pod, event.medium, event.group_idx))
        self.pods.setdefault(pod, _Pod()).refs[(event.medium, event.group_idx, own)] += 1

    def _remove(self, pod: str, event: Removed) -> None:
        state = self.pods.get(pod)
        holder = (pod, event.medium, event.group_idx)
        for own in event.block_hashes:
            if state is not None:
                ref = (event.medium, event.group_idx, own)
                count = state.refs.get(ref, 0)
                if count > 1:
                    state.refs[ref] = count - 1  # another store still holds it (llm-d's dedup filter's rule)
                    continue
                state.refs.pop(ref, None)
            checkpoint = self.checkpoints.get(own)
            if checkpoint is not None:
                self._drop(checkpoint.block_key, lambda h: h == holder, own)

    def _drop(self, key: int, which, own: int | None = None) -> None:
        """Take the holders `which` selects off the checkpoints at block `key` (only `own`'s when given)."""
        held = self.at_block.get(key)
        if held is None:
            return
        for h in [own] if own is not None else list(held):
            holders = held.get(h)
            if holders is None:
                continue
            holders -= {x for x in holders if which(x)}
            if not holders:
                del held[h]
                self.checkpoints.pop(h, None)
        if not held:
            del self.at_block[key]

    # -- scores -----------------------------------------------------------------------------------------------------

    def score(self, tokens: Seq[int], model: str, pods: Iterable[str] | None = None) -> dict[str, tuple[int, float]]:
        """{pod: (tokens it can resume at, weighted score)} for the pods with a checkpoint in the prompt: at each of
        the prompt's request keys, the checkpoints whose block ends there and whose tokens follow in the prompt, at
        most at its last token but one; the deepest per pod. The weighted score counts those tokens in canonical
        blocks x the weight of the checkpoint's tier (llm-d's weights: where its state is)."""
        index = self.attention
        size = index.block_size
        wanted = None if pods is None else set(pods)
        cap = len(tokens) - 1  # the engine computes the last token whatever is cached
        found: dict[str, tuple[int, float]] = {}
        for j, key in enumerate(index.request_keys(tokens, model)):
            end = (j + 1) * size
            for own, holders in self.at_block.get(key, {}).items():
                tail = self.checkpoints[own].tokens
                position = end + len(tail)
                if position > cap or tuple(tokens[end:position]) != tail:
                    continue
                for pod, tier, _ in holders:
                    if wanted is None or pod in wanted:
                        weight = position / size * index.weights.get(tier, OTHER_WEIGHT)
                        found[pod] = max(found.get(pod, (0, 0.0)), (position, weight))
        return found

    def matched_tokens(self, tokens: Seq[int], model: str, pod: str) -> int:
        return self.score(tokens, model, [pod]).get(pod, (0, 0.0))[0]
