"""The record every tier stores: a small header, the chunk's own key, then the payload.

    magic "TCHK" | version u8 | codec u8 | namespace_len u16 | key_len u8 | object_class u8 | flags u8
    | parent_len u8 | payload_len u64 | prefix_tokens u64 | checksum u64 | namespace (utf-8) | key | parent
    | [engine hash u64 | token bytes u32 | tokens]  (only with flag ENGINE)  | payload

`object_class` says whether the chunk is KV (evicted by recency) or a recurrent state (kept under its own byte budget
and evicted by value), `prefix_tokens` how many prefill tokens it saves (the state's value), and `parent` the key of
the object it extends in its chain (tiercache.hit_rule: a kv chunk's parent is the chunk before it; a tail's or a
state's the kv chunk it sits in), empty for opaque chunks. The eviction policy keeps a parent while its children live
and the server finds saved checkpoints through it. The store learns all three from the record, so they survive
restarts with the disk tier. (parent_len was a reserved zero byte: records written before it existed read as
records without a parent, and their checksums are unchanged.)

A kv object may also carry the engine's view of its block (flag ENGINE): its token ids (little-endian uint32) and the
engine's own 64-bit block hash. The server publishes KV events in vLLM's wire format from them (docs/events.md), and
routers recompute their keys from the tokens, so they live in the record and survive a restart with the disk tier.
Records without them are unchanged, checksums included.

A record written in place into host memory by a same-host client may be *unsealed* (flag UNSEALED, checksum 0):
memory records are never verified, so the checksum is computed only when the record leaves memory for the disk or
Redis tier (`sealed`). That keeps a full pass over the payload off the same-host put path, where it was 79% of the
server's time. A verifying read of an unsealed record fails like any corrupt one.

The checksum (xxh3-64) covers the header fields, the namespace, the key and the payload, so a record that was
truncated, bit-flipped, or written under another key's name is caught by `decode`. Carrying the key also lets the
disk tier rebuild its index from file contents alone after a restart.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from tiercache.errors import ChunkCorrupt
from tiercache.record import codec
from tiercache.record.keys import ChunkKey

MAGIC = b"TCHK"
FORMAT_VERSION = 1

CLASS_KV = 0  # attention KV, tails, and anything else: LRU
CLASS_STATE = 1  # recurrent-state checkpoints: own budget, evicted by value

_FIXED = struct.Struct("<4sBBHBBBBQQQ")
UNSEALED = 0x01
ENGINE = 0x02  # the engine block (engine hash, tokens) follows the parent
MAX_PARENT_BYTES = 64  # a parent is a key
MAX_TOKEN_BYTES = 4 << 18  # 262,144 token ids: far above any chunk size N
_ENGINE = struct.Struct("<QI")  # engine hash, token bytes
FIXED_HEADER_BYTES = _FIXED.size
# What the checksum covers from the fixed header: everything but the magic and the checksum itself.
_SUMMED = struct.Struct("<BBHBBQQ")


class ChunkMeta(NamedTuple):
    """What the store needs to know about a chunk besides its bytes."""

    object_class: int = CLASS_KV
    prefix_tokens: int = 0
    parent: bytes = b""  # the key (same namespace) of the object this one extends; b"": none
    # What the engine calls this block (for KV events for routers: docs/events.md), sent by connectors for the kv
    # chunks of one attention group in one rank only (one copy serves every group and rank): its token ids as
    # little-endian uint32, and the engine's own block hash (vLLM's, low 64 bits). b"" / 0: not sent.
    tokens: bytes = b""
    engine_hash: int = 0


def _engine_block(meta: ChunkMeta) -> bytes:
    """The engine block of a record's header: empty unless the meta carries tokens."""
    if not meta.tokens:
        return b""
    return _ENGINE.pack(meta.engine_hash, len(meta.tokens)) + meta.tokens


class RecordHeader(NamedTuple):
    key: ChunkKey
    codec: int
    payload_bytes: int
    header_bytes: int  # fixed part plus namespace and key: where the payload starts
    meta: ChunkMeta

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes


def header_bytes(key: ChunkKey, meta: ChunkMeta = ChunkMeta()) -> int:
    """Where the payload of a record for `key` with `meta` starts."""
    engine = _ENGINE.size + len(meta.tokens) if meta.tokens else 0
    return FIXED_HEADER_BYTES + len(key.namespace.encode()) + len(key.key) + len(meta.parent) + engine


def header(key: ChunkKey, meta: ChunkMeta, payload_parts, codec: int = codec.RAW, seal: bool = True) -> bytearray:
    """The header of a record whose payload is the concatenation of `payload_parts` (bytes-like objects).

    Parts let a payload that lies in several arena extents be summed where it lies, without gathering it first.
    `seal=False` leaves the checksum for later (see the module docstring): only lengths are needed then.
    """
    namespace = key.namespace.encode()
    parts = [memoryview(p).cast("B") for p in payload_parts]
    payload_len = sum(len(p) for p in parts)
    checksum = 0
    if seal:
        h = xxhash.xxh3_64()
        h.update(_SUMMED.pack(FORMAT_VERSION, codec, len(namespace), len(key.key), meta.object_class, payload_len,
                              meta.prefix_tokens))
        h.update(namespace)
        h.update(key.key)
        if meta.parent:  # only when present, so records without a parent keep the checksums they always had
            h.update(bytes((len(meta.parent),)) + meta.parent)
        if meta.tokens:  # likewise only when present
            h.update(_engine_block(meta))
        for part in parts:
            h.update(part)
        checksum = h.intdigest()
    out = bytearray(header_bytes(key, meta))
    flags = (0 if seal else UNSEALED) | (ENGINE if meta.tokens else 0)
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, codec, len(namespace), len(key.key), meta.object_class,
                     flags, len(meta.parent), payload_len, meta.prefix_tokens, checksum)
    out[FIXED_HEADER_BYTES:] = namespace + key.key + meta.parent + _engine_block(meta)
    return out


def sealed(record, key: ChunkKey):
    """The record with its checksum computed (the same object, sealed in place when it is writable)."""
    view = memoryview(record)
    if not _FIXED.unpack_from(view, 0)[6] & UNSEALED:
        return record
    parsed = read_header(view)
    if parsed.key != key:
        raise ChunkCorrupt(f"record holds {parsed.key}, expected {key}")
    head = header(key, parsed.meta, [view[parsed.header_bytes:]], parsed.codec)
    if view.readonly:
        return head + view[parsed.header_bytes:]
    view[:len(head)] = head
    return record


def seal(record: bytearray | memoryview, key: ChunkKey, meta: ChunkMeta = ChunkMeta(), codec: int = codec.RAW) -> None:
    """Write the header into the front of `record`, whose payload region is already filled.

    Lets a receiver assemble the payload in place (no extra copy) and seal it once complete.
    """
    view = memoryview(record)
    start = header_bytes(key, meta)
    view[:start] = header(key, meta, [view[start:]], codec)


def encode(key: ChunkKey, payload, meta: ChunkMeta = ChunkMeta(), codec: int = codec.RAW) -> bytearray:
    """A sealed record holding a copy of `payload` (any bytes-like object)."""
    start = header_bytes(key, meta)
    payload = memoryview(payload).cast("B")
    record = bytearray(start + len(payload))
    record[start:] = payload
    seal(record, key, meta, codec)
    return record


def read_meta(record) -> ChunkMeta:
    """Class, value, parent and engine block of a record, from its header (tiers call this on every put)."""
    fields = _FIXED.unpack_from(record, 0)
    start = FIXED_HEADER_BYTES + fields[3] + fields[4]
    parent = bytes(memoryview(record)[start:start + fields[7]]) if fields[7] else b""
    if not fields[6] & ENGINE:
        return ChunkMeta(fields[5], fields[9], parent)
    engine_hash, tokens = _read_engine(memoryview(record), start + fields[7])
    return ChunkMeta(fields[5], fields[9], parent, tokens, engine_hash)


def _read_engine(view: memoryview, at: int) -> tuple[int, bytes]:
    """(engine hash, tokens) of the engine block at `at`; ChunkCorrupt when it does not fit or is malformed."""
    if len(view) < at + _ENGINE.size:
        raise ChunkCorrupt("record truncated inside its engine block")
    engine_hash, token_bytes = _ENGINE.unpack_from(view, at)
    if not token_bytes or token_bytes % 4 or token_bytes > MAX_TOKEN_BYTES:
        raise ChunkCorrupt(f"engine block of {token_bytes} token bytes")
    end = at + _ENGINE.size + token_bytes
    if len(view) < end:
        raise ChunkCorrupt("record truncated inside its engine block")
    return engine_hash, bytes(view[at + _ENGINE.size:end])


def header_size(probe) -> int:
    """How many bytes of a record its header takes, from a probe of its first bytes that holds at least the fixed part
    and the engine block's length (the disk tier reads more when a header outgrows its probe)."""
    if len(probe) < FIXED_HEADER_BYTES:
        raise ChunkCorrupt(f"record of {len(probe)} bytes is shorter than a header")
    fields = _FIXED.unpack_from(probe, 0)
    size = FIXED_HEADER_BYTES + fields[3] + fields[4] + fields[7]
    if fields[6] & ENGINE and len(probe) >= size + _ENGINE.size:
        size += _ENGINE.size + _ENGINE.unpack_from(probe, size)[1]
    return size


def read_header(record) -> RecordHeader:
    """Parse the header only (the disk tier reads the first bytes of each file at start). Checks structure, not sum."""
    view = memoryview(record)
    if len(view) < FIXED_HEADER_BYTES:
        raise ChunkCorrupt(f"record of {len(view)} bytes is shorter than a header")
    magic, version, codec, ns_len, key_len, object_class, flags, parent_len, payload_len, prefix_tokens, _ = \
        _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise ChunkCorrupt("bad magic")
    # The flags byte stays outside the checksum (sealing clears UNSEALED in place), so it is checked here: a flipped
    # bit in it is caught like any other. parent_len is covered by the checksum through the parent it delimits.
    if flags & ~(UNSEALED | ENGINE) or parent_len > MAX_PARENT_BYTES:
        raise ChunkCorrupt(f"unknown header flags {flags:#x} / parent of {parent_len} bytes")
    if version != FORMAT_VERSION:
        raise ChunkCorrupt(f"unknown record format version {version}")
    key_end = FIXED_HEADER_BYTES + ns_len + key_len
    start = key_end + parent_len
    if len(view) < start:
        raise ChunkCorrupt("record truncated inside its key")
    engine_hash, tokens = _read_engine(view, start) if flags & ENGINE else (0, b"")
    try:
        namespace = bytes(view[FIXED_HEADER_BYTES:FIXED_HEADER_BYTES + ns_len]).decode()
        key = ChunkKey.checked(namespace, bytes(view[FIXED_HEADER_BYTES + ns_len:key_end]))
    except Exception as exc:  # bad utf-8 or an invalid key: the header is damaged
        raise ChunkCorrupt(f"bad key in header: {exc}") from exc
    meta = ChunkMeta(object_class, prefix_tokens, bytes(view[key_end:start]), tokens, engine_hash)
    return RecordHeader(key, codec, payload_len, header_bytes(key, meta), meta)


def decode(record, expected: ChunkKey, verify: bool = True) -> memoryview:
    """The payload of a record, after checking structure, key and (when `verify`) checksum.

    Raises ChunkCorrupt on any mismatch. `verify=False` is for records that never left this process's memory.
    """
    view = memoryview(record)
    parsed = read_header(view)
    if parsed.key != expected:
        raise ChunkCorrupt(f"record holds {parsed.key}, expected {expected}")
    if len(view) != parsed.record_bytes:
        raise ChunkCorrupt(f"record is {len(view)} bytes, header says {parsed.record_bytes}")
    payload = view[parsed.header_bytes:]
    fields = _FIXED.unpack_from(view, 0)
    if verify and (fields[6] & UNSEALED
                   or _FIXED.unpack_from(header(expected, parsed.meta, [payload], parsed.codec), 0)[-1] != fields[-1]):
        raise ChunkCorrupt(f"checksum mismatch for {expected}")
    if parsed.codec != codec.RAW:
        return memoryview(codec.decompress(parsed.codec, payload))
    return payload


def transcode(record, key: ChunkKey, target: int):
    """The record as a tier with codec `target` stores it (the same object when nothing changes).

    Records move between tiers with different codecs on demotion and promotion; the checksum is verified on the way.
    """
    parsed = read_header(record)
    if parsed.codec == target:
        return record
    payload = decode(record, key, verify=parsed.codec != codec.RAW)
    if target == codec.RAW:
        return encode(key, payload, parsed.meta)
    stored = codec.compress(target, payload)
    return header(key, parsed.meta, [stored], target) + stored
