"""The objects a hybrid model's prefix is cached as, and their keys. Pure functions.

Vocabulary (docs/architecture.md): a prompt of L tokens may reuse a prefix of p <= L-1 tokens (the engine computes at
least the last token itself). Objects, all named by the chain hash of the prefix they describe (prefix.hashes):
- `kv` at p = kN: one attention group's KV of tokens [p-N, p);
- `tail` at p (not a multiple of N): one attention group's KV of tokens [N*floor(p/N), p);
- `state` at p: every recurrent layer's state after tokens [0, p).
Which of them a hit needs is the hit rule (prefix.hit); which a request saves, admission (prefix.admission).

Every object names its *parent*, the object it extends in the chain: a kv chunk the kv chunk before it (the first
chunk a root that is never stored: h(0)), a tail the kv chunk it sits in, a state the kv chunk it sits in of the
first attention group (the *anchor*). The server keeps a chain shrinking from its deep end with it (tiers.index)
and finds every saved tail and state of a prefix through it, however far back from the prompt's end they lie
(prefix.lookup: one Lookup call, two when a checkpoint lies where the client sent no hash).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple

from tiercache.errors import InvalidArgument
from tiercache.prefix.hashes import HASH_BYTES, PrefixHashes
from tiercache.prefix.layout import GroupKind, ModelLayout, unified_block_size
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.record.keys import salt_suffix, validate_namespace


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

    @property
    def kv_chunk_bytes(self) -> int:
        """The KV bytes of one chunk, over every attention group (what a chunk boundary adds to a prefix)."""
        return self.layout.kv_bytes_per_token * self.chunk_tokens

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


OBJECT_KEY_BYTES = HASH_BYTES + 2  # the chain hash of the prefix, the kind, the layer group


def object_key(prefix_hash: bytes, kind: ObjectKind, group: int) -> bytes:
    return prefix_hash + key_suffix(kind, group)


def key_suffix(kind: ObjectKind, group: int) -> bytes:
    """What follows the chain hash in the key of a `kind` object of `group` (prefix.hit appends it to many hashes)."""
    return bytes((kind, group))


_KIND_OF = {kind.value: kind for kind in ObjectKind}  # a dict, not ObjectKind(x): parse is on every lookup's path


class ObjectKey(NamedTuple):
    """An object's key taken apart: the chain hash of the prefix it describes, its kind, its layer group. This module
    is the only one that builds or slices object keys (tests/test_architecture.py holds it); the others parse."""

    prefix_hash: bytes
    kind: ObjectKind
    group: int

    @classmethod
    def parse(cls, key: bytes) -> "ObjectKey | None":
        """The parts of `key`, or None when it is no prefix object's key (an opaque chunk's)."""
        kind = _KIND_OF.get(key[HASH_BYTES]) if len(key) == OBJECT_KEY_BYTES else None
        return None if kind is None else cls(key[:HASH_BYTES], kind, key[HASH_BYTES + 1])


class ObjectRef(NamedTuple):
    """One cache object: the prefix length p it describes, its kind and layer group, its key (OBJECT_KEY_BYTES), and
    the key of its parent (see the module docstring).

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
    return ref_with_parent(n, hashes.at(position), hashes.at(below), kind, position, group, shape_of(spec).anchor)


def ref_with_parent(n: int, prefix_hash: bytes, below_hash: bytes, kind: ObjectKind, position: int, group: int,
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


def shape_of(spec) -> ChainShape:
    return spec if isinstance(spec, ChainShape) else spec.shape
