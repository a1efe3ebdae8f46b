"""Hybrid-aware prefix caching rules: object keys, the lookup probe, the hit rule, and admission. Pure functions.

Vocabulary (DESIGN.md): a prompt of L tokens may reuse a prefix of p <= L-1 tokens (the engine computes at least the
last token itself). Objects, all named by the chain hash of the prefix they describe (tiercache.keys.PrefixHashes):
- `kv` at p = kN: one attention group's KV of tokens [p-N, p);
- `tail` at p (not a multiple of N): one attention group's KV of tokens [N*floor(p/N), p);
- `state` at p: every recurrent layer's state after tokens [0, p).
The hit is the largest p such that each full-attention group has every kv chunk up to N*floor(p/N), each sliding-window
group has the chunks overlapping [p-W, p), the tail exists when p is not a multiple of N, and the state exists when the
model has recurrent layers.

Which positions can hold a hit? Chunk boundaries (kv chains and boundary states) and the positions where earlier
requests ended (tails and states saved at a prompt's last token and at a request's end). The probe asks, in ONE
Exists call, for every chunk boundary and for every position of the last `window_tokens` (default N) before L-1:
that finds exact repeats (L-1), the previous turn's end in a chat whose new message is shorter than the window,
and boundary states anywhere. An earlier request's end further back than the window is reached through the
boundary state below it (at most N tokens recomputed). Probing every position would cost L keys per lookup.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Container, Mapping, NamedTuple, Sequence

from tiercache.errors import InvalidArgument
from tiercache.keys import PrefixHashes, salt_suffix, validate_namespace
from tiercache.layout import GroupKind, ModelLayout, unified_block_size


class ObjectKind(enum.IntEnum):
    KV = 1
    TAIL = 2
    STATE = 3


@dataclass(frozen=True)
class CacheSpec:
    """How one engine rank caches one model: layout, N, u, and the namespace all its objects live in."""

    layout: ModelLayout
    chunk_tokens: int
    match_unit: int = 16
    salt: str = ""
    window_tokens: int = 0  # positions probed one by one before the prompt's end; 0 means N
    max_boundary_states: int = 8  # boundary states saved per request, spaced exponentially back from the end

    def __post_init__(self) -> None:
        if self.match_unit <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.match_unit:
            raise InvalidArgument(f"u={self.match_unit} must be positive and divide N={self.chunk_tokens}")
        if not self.window_tokens:
            object.__setattr__(self, "window_tokens", self.chunk_tokens)
        validate_namespace(self.namespace)

    @classmethod
    def for_layout(cls, layout: ModelLayout, *, match_unit: int = 16, chunk_tokens: int | None = None,
                   **options) -> "CacheSpec":
        """N defaults to the unified block size an engine would use for this layout."""
        n = chunk_tokens or max(unified_block_size(layout), match_unit)
        return cls(layout, n, match_unit, **options)

    @functools.cached_property
    def recurrent_flags(self) -> tuple[bool, ...]:
        return tuple(g.kind is GroupKind.RECURRENT for g in self.layout.groups)

    @property
    def namespace(self) -> str:
        """model@revision#fingerprint[~salt digest]: what may share bytes. The salt itself never appears."""
        fingerprint = self.layout.fingerprint(self.chunk_tokens, self.match_unit)
        text = f"{self.layout.model}@{self.layout.revision}#{fingerprint}"
        if self.salt:
            text += salt_suffix(self.salt)
        return text

    def hashes(self, tokens) -> PrefixHashes:
        return PrefixHashes(self.namespace, tokens, self.chunk_tokens, self.match_unit)

    def object_bytes(self, ref: "ObjectRef") -> int:
        """The payload size an object of this layout has (what an engine writes; the bench uses it)."""
        if ref.kind is ObjectKind.STATE:
            return self.layout.state_bytes
        return self.layout.groups[ref.group].kv_bytes_per_token * ref.tokens


class ObjectRef(NamedTuple):
    """One cache object: the prefix length p it describes, its kind and layer group, and its 18-byte key.

    (A NamedTuple rather than a dataclass: a 262,144-token lookup builds ~2,000 of them, and this is 3x cheaper.)
    """

    position: int
    kind: ObjectKind
    group: int
    key: bytes
    start: int  # first token whose KV it holds (0 for states)

    @property
    def tokens(self) -> int:
        return self.position - self.start


def object_ref(spec: CacheSpec, hashes: PrefixHashes, kind: ObjectKind, position: int, group: int) -> ObjectRef:
    n = spec.chunk_tokens
    if kind is ObjectKind.KV and (position % n or position <= 0):
        raise InvalidArgument(f"kv objects sit at multiples of N={n}, not {position}")
    if kind is ObjectKind.TAIL and position % n == 0:
        raise InvalidArgument(f"tail objects sit between chunk boundaries, not at {position}")
    return _ref(spec, hashes.at(position), kind, position, group)


def _ref(spec: CacheSpec, prefix_hash: bytes, kind: ObjectKind, position: int, group: int) -> ObjectRef:
    if kind is ObjectKind.STATE:
        start = 0
    elif kind is ObjectKind.KV:
        start = position - spec.chunk_tokens
    else:
        start = position - position % spec.chunk_tokens
    return ObjectRef(position, kind, group, prefix_hash + bytes((kind, group)), start)


@dataclass(frozen=True)
class Located:
    ref: ObjectRef
    tier: str


@dataclass(frozen=True)
class Probe:
    """The keys one lookup asks about, and the candidate hit positions they decide, deepest first."""

    prompt_tokens: int
    candidates: tuple[int, ...]
    objects: tuple[ObjectRef, ...]

    @property
    def keys(self) -> list[bytes]:
        return [o.key for o in self.objects]


@dataclass(frozen=True)
class Hit:
    """The result of a lookup: reuse `tokens` of `prompt_tokens`, by loading `objects` (with the tier of each)."""

    tokens: int
    prompt_tokens: int
    objects: tuple[Located, ...] = ()

    @property
    def ratio(self) -> float:
        return self.tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tokens_by_tier(self) -> dict[str, int]:
        """Hit tokens attributed to the tier their KV came from (states count for the tokens no KV covers)."""
        by_tier: dict[str, int] = {}
        attention = [o for o in self.objects if o.ref.kind is not ObjectKind.STATE]
        first_group = min((o.ref.group for o in attention), default=None)
        for o in attention:
            if o.ref.group == first_group:
                by_tier[o.tier] = by_tier.get(o.tier, 0) + o.ref.tokens
        covered = sum(by_tier.values())
        if covered < self.tokens:
            state = next((o for o in self.objects if o.ref.kind is ObjectKind.STATE), None)
            if state is not None:
                by_tier[state.tier] = by_tier.get(state.tier, 0) + self.tokens - covered
        return by_tier


# -- lookup ------------------------------------------------------------------------------------------------------

def plan_probe(spec: CacheSpec, hashes: PrefixHashes) -> Probe:
    """Every key whose presence decides the hit of a prompt of `hashes.length` tokens."""
    length = hashes.length
    last = length - 1
    n = spec.chunk_tokens
    if last < 1:
        return Probe(length, (), ())
    boundaries = [k * n for k in range(1, last // n + 1)]
    window = [p for p in range(max(1, last - spec.window_tokens + 1), last + 1) if p % n]
    candidates = tuple(sorted(set(boundaries + window), reverse=True))
    objects = [ref for p in candidates for ref in _objects_at(spec, hashes, p, boundary_kv=True)]
    return Probe(length, candidates, tuple(objects))


def resolve_hit(spec: CacheSpec, hashes: PrefixHashes, probe: Probe, where: Sequence[str | None]) -> Hit:
    """Apply the hit rule to the presence (tier or None) of each probed key. Linear in the probe's size: kv chains
    are summarised once per group, then candidates are checked deepest first."""
    tier_of = {(ref.kind, ref.position, ref.group): tier for ref, tier in zip(probe.objects, where) if tier}
    n = spec.chunk_tokens
    deepest = (probe.prompt_tokens - 1) // n if probe.prompt_tokens else 0
    missing_before = {}  # attention group -> prefix counts of missing kv chunks, index k = chunks 1..k
    for index, group in enumerate(spec.layout.groups):
        if group.is_attention:
            counts = [0]
            for k in range(1, deepest + 1):
                counts.append(counts[-1] + ((ObjectKind.KV, k * n, index) not in tier_of))
            missing_before[index] = counts

    def resumable(p: int) -> bool:
        for index, group in enumerate(spec.layout.groups):
            if group.kind is GroupKind.RECURRENT:
                if (ObjectKind.STATE, p, index) not in tier_of:
                    return False
                continue
            first = 1 if group.kind is GroupKind.FULL_ATTENTION else max(1, (p - group.window) // n + 1)
            counts = missing_before[index]
            if counts[p // n] - counts[first - 1] > 0:
                return False
            if p % n and (ObjectKind.TAIL, p, index) not in tier_of:
                return False
        return True

    for p in probe.candidates:  # deepest first
        if resumable(p):
            needed = required_objects(spec, hashes, p)
            located = tuple(Located(ref, tier_of[(ref.kind, ref.position, ref.group)]) for ref in needed)
            return Hit(p, probe.prompt_tokens, located)
    return Hit(0, probe.prompt_tokens)


def required_objects(spec: CacheSpec, hashes: PrefixHashes, p: int) -> list[ObjectRef]:
    """What must be loaded to resume at p: the hit rule, spelled out per layer group."""
    n = spec.chunk_tokens
    needed = []
    for index, group in enumerate(spec.layout.groups):
        if group.kind is GroupKind.RECURRENT:
            needed.append(object_ref(spec, hashes, ObjectKind.STATE, p, index))
            continue
        first = 1
        if group.kind is GroupKind.SLIDING_WINDOW:  # only chunks overlapping [p - W, p)
            first = max(1, (p - group.window) // n + 1)
        needed += [object_ref(spec, hashes, ObjectKind.KV, k * n, index) for k in range(first, p // n + 1)]
        if p % n:
            needed.append(object_ref(spec, hashes, ObjectKind.TAIL, p, index))
    return needed


def _objects_at(spec: CacheSpec, hashes: PrefixHashes, p: int, boundary_kv: bool) -> list[ObjectRef]:
    """The objects named at position p: kv (at boundaries) or tails per attention group, and the state."""
    prefix_hash = hashes.at(p)
    n = spec.chunk_tokens
    attention_kind = ObjectKind.TAIL if p % n else (ObjectKind.KV if boundary_kv else None)
    attention_start = p - p % n if p % n else p - n
    refs = []
    for index, recurrent in enumerate(spec.recurrent_flags):  # the hot loop of a lookup: kept plain
        if recurrent:
            refs.append(ObjectRef(p, ObjectKind.STATE, index, prefix_hash + bytes((ObjectKind.STATE, index)), 0))
        elif attention_kind is not None:
            refs.append(ObjectRef(p, attention_kind, index, prefix_hash + bytes((attention_kind, index)),
                                  attention_start))
    return refs


# -- admission ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SavePlan:
    """What to write after computing tokens [hit, end): the objects, and the positions where the engine must stop
    its forward pass to capture a state (ascending)."""

    objects: tuple[ObjectRef, ...]
    state_positions: tuple[int, ...]


def plan_prompt_admission(spec: CacheSpec, hashes: PrefixHashes, hit_tokens: int,
                          present: Mapping[bytes, str] | None = None) -> SavePlan:
    """Objects a prefill of the whole prompt (tokens [hit, L) computed) should save.

    Every full kv chunk; tail + state at L-1 so an exact repeat hits L-1; boundary states at the deepest chunk
    boundaries, spaced 1, 2, 4, ... chunks back from the end (a later prompt diverging d tokens before this one's
    end finds a state about d tokens back or closer); nothing already present.
    """
    length = hashes.length
    n = spec.chunk_tokens
    kv_positions = [k * n for k in range(hit_tokens // n + 1, length // n + 1)]
    states = _boundary_state_positions(spec, hit_tokens, length - 1) if spec.layout.is_hybrid else []
    ends = [length - 1] if length - 1 > hit_tokens else []
    return _plan(spec, hashes, kv_positions, states, ends, present or {})


def plan_finish_admission(spec: CacheSpec, hashes: PrefixHashes, prompt_tokens: int,
                          present: Mapping[bytes, str] | None = None) -> SavePlan:
    """Objects to save when a request ends with KV and state for all `hashes.length` tokens (prompt + output):
    the kv chunks the output completed, and tail + state at the end, for the next turn of a conversation."""
    end = hashes.length
    n = spec.chunk_tokens
    kv_positions = [k * n for k in range(prompt_tokens // n + 1, end // n + 1)]
    ends = [end] if end > prompt_tokens - 1 else []
    return _plan(spec, hashes, kv_positions, [], ends, present or {})


def plan_step_admission(spec: CacheSpec, hashes: PrefixHashes, prompt_tokens: int, hit_tokens: int,
                        computed: tuple[int, int], offered_states: Sequence[int] = (),
                        present: Container[bytes] = ()) -> SavePlan:
    """Objects to save after one step of an engine that computes a request step by step and keeps recurrent states
    only where it chose to (vLLM: align-mode block boundaries and the prompt's last hash boundary): every kv chunk
    the step completed in `computed` = [start, end), and, of the states the engine `offered_states` (positions),
    those the prompt's admission wants, each with its tails when it sits between chunks.

    The prompt's admission (plan_prompt_admission) wants the boundary states spaced 1, 2, 4, ... chunks back from
    the prompt's end (at most `max_boundary_states`) and the state at the prompt's end; an engine that cannot stop
    at L-1 offers the last state it keeps below it, so any offered state past the deepest chunk boundary below L-1
    counts as the prompt's end. States past the prompt (decode) are left to plan_finish_admission (the request's
    end). `hashes` must cover every position planned."""
    n = spec.chunk_tokens
    start, end = computed
    kv_positions = [k * n for k in range(start // n + 1, end // n + 1)]
    states: list[int] = []
    if spec.layout.is_hybrid:
        last = prompt_tokens - 1
        wanted = set(_boundary_state_positions(spec, hit_tokens, last))
        states = [p for p in offered_states if p in wanted or last // n * n < p <= last]
    return _plan(spec, hashes, kv_positions, states, [], present)


def _boundary_state_positions(spec: CacheSpec, after: int, last: int) -> list[int]:
    n = spec.chunk_tokens
    deepest = last // n
    positions, back = [], 0
    while len(positions) < spec.max_boundary_states and deepest - back >= 1:
        p = (deepest - back) * n
        if p <= after:
            break
        positions.append(p)
        back = 2 * back + 1  # 0, 1, 3, 7, ...: spacing doubles going back
    return sorted(positions)


def _plan(spec: CacheSpec, hashes: PrefixHashes, kv_positions: list[int], state_positions: list[int],
          end_positions: list[int], present: Container[bytes]) -> SavePlan:
    objects: dict[bytes, ObjectRef] = {}
    attention = [i for i, g in enumerate(spec.layout.groups) if g.is_attention]
    for p in kv_positions:
        for g in attention:
            ref = object_ref(spec, hashes, ObjectKind.KV, p, g)
            objects[ref.key] = ref
    for p in sorted(set(state_positions) | set(end_positions)):
        for ref in _objects_at(spec, hashes, p, boundary_kv=False):
            objects[ref.key] = ref
    wanted = tuple(sorted(ref for key, ref in objects.items() if key not in present))
    captures = tuple(sorted({ref.position for ref in wanted if ref.kind is not ObjectKind.KV}))
    return SavePlan(wanted, captures if spec.layout.is_hybrid else ())
