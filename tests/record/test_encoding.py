"""The record every tier stores (tiercache.record.encoding): round trips, the checksum that catches every bit flip,
truncation and misplacement, sealing in place, and unsealed records trusted only in memory."""

import os

import pytest

from tiercache.errors import ChunkCorrupt
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey

KEY = ChunkKey("model@rev/layout", b"\x01" * 16)


def test_round_trip_returns_the_payload():
    payload = os.urandom(12345)
    record = encoding.encode(KEY, payload)
    assert len(record) == encoding.header_bytes(KEY) + len(payload)
    assert bytes(encoding.decode(record, KEY)) == payload


def test_empty_payload_round_trips():
    assert bytes(encoding.decode(encoding.encode(KEY, b""), KEY)) == b""


def test_header_carries_the_key():
    header = encoding.read_header(encoding.encode(KEY, b"abc"))
    assert header.key == KEY and header.payload_bytes == 3


@pytest.mark.parametrize("seed", range(20))
def test_every_single_bit_flip_is_detected(seed):
    rng = __import__("random").Random(seed)
    record = encoding.encode(KEY, os.urandom(4096))
    position = rng.randrange(len(record) * 8)
    record[position // 8] ^= 1 << (position % 8)
    with pytest.raises(ChunkCorrupt):
        encoding.decode(record, KEY)


def test_truncated_record_is_corrupt():
    record = encoding.encode(KEY, os.urandom(100))
    for cut in (0, 5, encoding.FIXED_HEADER_BYTES + 3, len(record) - 1):
        with pytest.raises(ChunkCorrupt):
            encoding.decode(record[:cut], KEY)


def test_record_under_another_key_is_corrupt():
    record = encoding.encode(KEY, b"payload")
    with pytest.raises(ChunkCorrupt):
        encoding.decode(record, ChunkKey(KEY.namespace, b"\x02" * 16))


def test_seal_in_place_equals_encode():
    payload = os.urandom(999)
    buf = bytearray(encoding.header_bytes(KEY) + len(payload))
    buf[encoding.header_bytes(KEY):] = payload
    encoding.seal(buf, KEY)
    assert buf == encoding.encode(KEY, payload)


def test_unsealed_record_is_trusted_only_in_memory_and_sealed_on_the_way_out():
    payload = os.urandom(5000)
    head = encoding.header(KEY, encoding.ChunkMeta(), [payload], seal=False)
    record = head + payload
    assert bytes(encoding.decode(record, KEY, verify=False)) == payload
    with pytest.raises(ChunkCorrupt):
        encoding.decode(record, KEY)  # a verifying tier never accepts an unsealed record
    assert encoding.sealed(record, KEY) is record
    assert record == encoding.encode(KEY, payload) and bytes(encoding.decode(record, KEY)) == payload
    assert encoding.sealed(bytes(record), KEY) == record  # already sealed: unchanged
    readonly = bytes(head + payload)
    assert encoding.sealed(readonly, KEY) == encoding.encode(KEY, payload)  # read-only input: a sealed copy


def test_every_single_bit_flip_of_a_record_is_detected():
    """Header (magic, lengths, flags, the reserved byte, meta, checksum), key and payload: no flip decodes."""
    key = ChunkKey("model@rev#fp", b"k" * 18)
    record = encoding.encode(key, bytes(range(100)), encoding.ChunkMeta(encoding.CLASS_STATE, 544))
    undetected = []
    for bit in range(len(record) * 8):
        flipped = bytearray(record)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            encoding.decode(flipped, key)
        except ChunkCorrupt:
            continue
        undetected.append((bit // 8, bit % 8))
    assert undetected == []


ENGINE_META = encoding.ChunkMeta(encoding.CLASS_KV, 4, b"p" * 18, tokens=bytes(range(16)), engine_hash=2**64 - 5)


def test_the_engine_block_round_trips_and_is_in_the_header():
    """A kv chunk's token ids and engine hash live in its record (so a disk tier's restart keeps them)."""
    record = encoding.encode(KEY, b"payload", ENGINE_META)
    assert encoding.read_meta(record) == ENGINE_META
    header = encoding.read_header(record)
    assert header.meta == ENGINE_META and header.header_bytes == encoding.header_bytes(KEY, ENGINE_META)
    assert encoding.header_size(record[:header.header_bytes]) == header.header_bytes
    assert bytes(encoding.decode(record, KEY)) == b"payload"
    unsealed = encoding.header(KEY, ENGINE_META, [b"payload"], seal=False) + b"payload"
    assert encoding.sealed(unsealed, KEY) == record


def test_records_without_tokens_are_what_they_always_were():
    meta = encoding.ChunkMeta(encoding.CLASS_KV, 4, b"p" * 18)
    record = encoding.encode(KEY, b"payload", meta)
    assert record[10] == 0  # flags: no engine block
    assert len(record) == encoding.FIXED_HEADER_BYTES + len(KEY.namespace) + 16 + 18 + 7


def test_every_single_bit_flip_of_a_record_with_tokens_is_detected():
    record = encoding.encode(KEY, bytes(range(40)), ENGINE_META)
    undetected = []
    for bit in range(len(record) * 8):
        flipped = bytearray(record)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            encoding.decode(flipped, KEY)
        except ChunkCorrupt:
            continue
        undetected.append((bit // 8, bit % 8))
    assert undetected == []
