"""Hybrid-aware prefix caching rules: object keys, the hit rule, and admission. Pure functions.

Vocabulary (DESIGN.md): a prompt of L tokens may reuse a prefix of p <= L-1 tokens (the engine computes at least the
last token itself). Objects, all named by the chain hash of the prefix they describe (tiercache.keys.PrefixHashes):
- `kv` at p = kN: one attention group's KV of tokens [p-N, p);
- `tail` at p (not a multiple of N): one attention group's KV of tokens [N*floor(p/N), p);
- `state` at p: every recurrent layer's state after tokens [0, p).
The hit is the largest p such that each full-attention group has every kv chunk up to N*floor(p/N), each sliding-window
group has the chunks overlapping [p-W, p), the tail exists when p is not a multiple of N, and the state exists when the
model has recurrent layers.

Every object names its *parent*, the object it extends in the chain: a kv chunk the kv chunk before it (the first
chunk a root that is never stored: h(0)), a tail the kv chunk it sits in, a state the kv chunk it sits in of the
first attention group (the *anchor*). The server keeps a chain shrinking from its deep end with it (tiercache.lru)
and finds every saved tail and state of a prefix through it, however far back from the prompt's end they lie
(tiercache.chain_lookup: one Lookup call, two when a checkpoint lies where the client sent no hash).

Which positions can hold a hit? Chunk boundaries (kv chains and boundary states) and the positions where earlier
requests ended (tails and states saved at a prompt's last token and at a request's end).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Container, Iterable, Mapping, NamedTuple, Sequence

from tiercache.chunk import CLASS_KV, CLASS_STATE, ChunkMeta
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
    # Boundary states saved per request, the deepest first; 0: one at every chunk boundary, so that a prompt
    # branching anywhere inside an earlier one resumes within N tokens of the branch (the state budget and its value
    # score decide which survive).
    max_boundary_states: int = 0

    def __post_init__(self) -> None:
        if self.match_unit <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.match_unit:
            raise InvalidArgument(f"u={self.match_unit} must be positive and divide N={self.chunk_tokens}")
        validate_namespace(self.namespace)

    @classmethod
    def for_layout(cls, layout: ModelLayout, *, match_unit: int = 16, chunk_tokens: int | None = None,
                   **options) -> "CacheSpec":
        """N defaults to the unified block size an engine would use for this layout."""
        n = chunk_tokens or max(unified_block_size(layout), match_unit)
        return cls(layout, n, match_unit, **options)

    @functools.cached_property
    def shape(self) -> "ChainShape":
        return ChainShape(self.chunk_tokens, tuple(g.kind for g in self.layout.groups),
                          tuple(g.window for g in self.layout.groups))

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


@dataclass(frozen=True)
class ChainShape:
    """What the hit rule needs of a layout: N and each layer group's kind (and window). The server receives it in a
    Lookup request; a CacheSpec derives it from its layout."""

    chunk_tokens: int
    kinds: tuple[GroupKind, ...]
    windows: tuple[int | None, ...]

    @functools.cached_property
    def attention(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind is not GroupKind.RECURRENT)

    @functools.cached_property
    def recurrent(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind is GroupKind.RECURRENT)

    @property
    def anchor(self) -> int:
        """The group whose kv chunks parent the states (the first attention group; group 0 when there is none,
        whose 'kv' keys are then only names)."""
        return self.attention[0] if self.attention else 0

    def first_chunk(self, group: int, p: int) -> int:
        """The first kv chunk (1-based) group `group` needs to resume at p: 1, or the first overlapping [p-W, p)."""
        window = self.windows[group]
        return 1 if window is None else max(1, (p - window) // self.chunk_tokens + 1)


def object_key(prefix_hash: bytes, kind: ObjectKind, group: int) -> bytes:
    return prefix_hash + bytes((kind, group))


class ObjectRef(NamedTuple):
    """One cache object: the prefix length p it describes, its kind and layer group, its 18-byte key, and the key
    of its parent (see the module docstring).

    (A NamedTuple rather than a dataclass: a 262,144-token lookup builds ~2,000 of them, and this is 3x cheaper.)
    """

    position: int
    kind: ObjectKind
    group: int
    key: bytes
    start: int  # first token whose KV it holds (0 for states)
    parent: bytes

    @property
    def tokens(self) -> int:
        return self.position - self.start


def object_ref(spec, hashes, kind: ObjectKind, position: int, group: int) -> ObjectRef:
    """The object of `kind` at `position` for `group`; `spec` is a CacheSpec or a ChainShape, `hashes` anything with
    `at(p)` for the positions involved."""
    n = spec.chunk_tokens
    if kind is ObjectKind.KV and (position % n or position <= 0):
        raise InvalidArgument(f"kv objects sit at multiples of N={n}, not {position}")
    if kind is ObjectKind.TAIL and position % n == 0:
        raise InvalidArgument(f"tail objects sit between chunk boundaries, not at {position}")
    below = position - n if kind is ObjectKind.KV else position - position % n
    return _ref(n, hashes.at(position), hashes.at(below), kind, position, group, _shape(spec).anchor)


def _ref(n: int, prefix_hash: bytes, below_hash: bytes, kind: ObjectKind, position: int, group: int,
         anchor: int) -> ObjectRef:
    """`below_hash` names the boundary of the parent: (p - N) for kv, N*floor(p/N) for the others."""
    if kind is ObjectKind.STATE:
        start, parent = 0, object_key(below_hash, ObjectKind.KV, anchor)
    elif kind is ObjectKind.KV:
        start, parent = position - n, object_key(below_hash, ObjectKind.KV, group)
    else:
        start, parent = position - position % n, object_key(below_hash, ObjectKind.KV, group)
    return ObjectRef(position, kind, group, object_key(prefix_hash, kind, group), start, parent)


def object_meta(ref: ObjectRef) -> ChunkMeta:
    """How the server values and chains an object: a state saves its position's prefill, KV its tokens (which also
    places a tail inside its chunk); both name their parent."""
    if ref.kind is ObjectKind.STATE:
        return ChunkMeta(CLASS_STATE, ref.position, ref.parent)
    return ChunkMeta(CLASS_KV, ref.tokens, ref.parent)


def _shape(spec) -> ChainShape:
    return spec if isinstance(spec, ChainShape) else spec.shape


@dataclass(frozen=True)
class Located:
    ref: ObjectRef
    tier: str


@dataclass(frozen=True)
class Hit:
    """The result of a lookup: reuse `tokens` of `prompt_tokens`, by loading `objects` (with the tier of each).

    `chain_chunks`: how many kv chunks of the prompt every attention group holds from the start (the server walked
    them): admission need not save those again."""

    tokens: int
    prompt_tokens: int
    objects: tuple[Located, ...] = ()
    chain_chunks: int = 0

    @property
    def ratio(self) -> float:
        return self.tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tokens_by_tier(self) -> dict[str, int]:
        return tokens_by_tier(self.tokens, ((o.ref.kind, o.ref.group, o.ref.tokens, o.tier) for o in self.objects))


def tokens_by_tier(hit_tokens: int, objects: Iterable[tuple[ObjectKind, int, int, str]]) -> dict[str, int]:
    """Hit tokens attributed to the tier their KV came from (the first attention group's objects; the state counts
    for the tokens no KV covers). `objects`: (kind, group, tokens of KV held, tier) of each object of the hit."""
    by_tier: dict[str, int] = {}
    first_group = None
    state_tier = None
    for kind, group, tokens, tier in objects:
        if kind is ObjectKind.STATE:
            state_tier = tier
            continue
        first_group = group if first_group is None else first_group
        if group == first_group:
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    covered = sum(by_tier.values())
    if covered < hit_tokens and state_tier is not None:
        by_tier[state_tier] = by_tier.get(state_tier, 0) + hit_tokens - covered
    return by_tier


def required_objects(spec, hashes, p: int) -> list[ObjectRef]:
    """What must be loaded to resume at p: the hit rule, spelled out per layer group (kv chunks in order, then the
    tail, per attention group; the state for the recurrent group). `spec`: a CacheSpec or a ChainShape.

    (Built inline rather than through object_ref: a 262,144-token hit names ~500 objects per group, and this is on
    every lookup's path.)"""
    shape = _shape(spec)
    n = shape.chunk_tokens
    at = hashes.at
    needed: list[ObjectRef] = []
    for group, kind in enumerate(shape.kinds):
        if kind is GroupKind.RECURRENT:
            needed.append(object_ref(shape, hashes, ObjectKind.STATE, p, group))
            continue
        first = shape.first_chunk(group, p)
        suffix = bytes((ObjectKind.KV, group))
        chain = [at(k * n) + suffix for k in range(first - 1, p // n + 1)]  # kv keys (and h(0)'s root) in order
        needed += [ObjectRef(k * n, ObjectKind.KV, group, chain[i + 1], k * n - n, chain[i])
                   for i, k in enumerate(range(first, p // n + 1))]
        if p % n:
            needed.append(object_ref(shape, hashes, ObjectKind.TAIL, p, group))
    return needed


def checkpoint_objects(spec, hashes, p: int) -> list[ObjectRef]:
    """The checkpoint objects at position p: a tail per attention group (between boundaries), and the state."""
    shape = _shape(spec)
    n = shape.chunk_tokens
    prefix_hash, below = hashes.at(p), hashes.at(p - p % n)
    return [_ref(n, prefix_hash, below, ObjectKind.STATE if kind is GroupKind.RECURRENT else ObjectKind.TAIL, p,
                 group, shape.anchor)
            for group, kind in enumerate(shape.kinds) if kind is GroupKind.RECURRENT or p % n]


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

    Every full kv chunk; tail + state at L-1 so an exact repeat hits L-1; a state at every chunk boundary (the
    deepest `max_boundary_states` when set), so a later prompt that branches anywhere inside this one resumes within
    N tokens of the branch; nothing already present.
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

    The prompt's admission (plan_prompt_admission) wants the boundary states (the deepest `max_boundary_states`
    when set) and the state at the prompt's end; an engine that cannot stop
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
    """Chunk boundaries in (after, last], the deepest `max_boundary_states` of them (all when 0)."""
    n = spec.chunk_tokens
    positions = [k * n for k in range(after // n + 1, last // n + 1)]
    return positions[-spec.max_boundary_states:] if spec.max_boundary_states else positions


def _plan(spec: CacheSpec, hashes: PrefixHashes, kv_positions: list[int], state_positions: list[int],
          end_positions: list[int], present: Container[bytes]) -> SavePlan:
    objects: dict[bytes, ObjectRef] = {}
    attention = [i for i, g in enumerate(spec.layout.groups) if g.is_attention]
    for p in kv_positions:
        for g in attention:
            ref = object_ref(spec, hashes, ObjectKind.KV, p, g)
            objects[ref.key] = ref
    for p in sorted(set(state_positions) | set(end_positions)):
        for ref in checkpoint_objects(spec, hashes, p):
            objects[ref.key] = ref
    wanted = tuple(sorted(ref for key, ref in objects.items() if key not in present))
    captures = tuple(sorted({ref.position for ref in wanted if ref.kind is not ObjectKind.KV}))
    return SavePlan(wanted, captures if spec.layout.is_hybrid else ())
