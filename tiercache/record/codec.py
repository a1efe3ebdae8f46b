"""Optional compression of records in the disk and Redis tiers: lz4 frames, with a byte shuffle for 16-bit floats.

bf16 / fp16 KV compresses poorly as is (lz4 sees no repeats), but after splitting each 2-byte value into a high-byte
plane and a low-byte plane the high bytes (sign and exponent) repeat a lot. The shuffle width is a tier setting
(`lz4-shuffle2` for bf16/fp16 KV, `lz4-shuffle4` for fp32 states), since the server never looks inside chunks.

Measured here (docs/performance.md, benchmarks/codec.py): ~1.2x on bf16 KV at 0.15-0.2 GB/s compression against
2-3 GB/s of raw file writes, so every codec is off by default: it buys capacity (Redis memory), not speed.

A compressed record keeps the record format: the header's codec flag is set, payload_len is the stored length, the
checksum covers the stored bytes (corruption is caught before decompressing), and the payload starts with the raw
length (u64) so decoding can allocate once.
"""

from __future__ import annotations

import struct

import numpy as np

from tiercache.errors import ChunkCorrupt, ConfigError

RAW, LZ4, LZ4_SHUFFLE2, LZ4_SHUFFLE4 = 0, 1, 2, 3
NAMES = {"none": RAW, "lz4": LZ4, "lz4-shuffle2": LZ4_SHUFFLE2, "lz4-shuffle4": LZ4_SHUFFLE4}
_WIDTH = {LZ4: 1, LZ4_SHUFFLE2: 2, LZ4_SHUFFLE4: 4}
_LENGTH = struct.Struct("<Q")


def codec_id(name: str) -> int:
    try:
        return NAMES[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r} (known: {', '.join(NAMES)})") from None


def compress(codec: int, payload) -> bytes:
    import lz4.frame

    data = memoryview(payload).cast("B")
    shuffled = _shuffle(data, _WIDTH[codec])
    return _LENGTH.pack(len(data)) + lz4.frame.compress(shuffled, compression_level=0, store_size=False)


def decompress(codec: int, stored) -> bytes:
    import lz4.frame

    if codec not in _WIDTH:
        raise ChunkCorrupt(f"unknown codec {codec}")
    stored = memoryview(stored).cast("B")
    if len(stored) < _LENGTH.size:
        raise ChunkCorrupt("compressed payload too short")
    (length,) = _LENGTH.unpack_from(stored, 0)
    try:
        data = lz4.frame.decompress(stored[_LENGTH.size:])
    except RuntimeError as exc:
        raise ChunkCorrupt(f"lz4 frame does not decompress: {exc}") from None
    if len(data) != length:
        raise ChunkCorrupt(f"decompressed {len(data)} bytes, expected {length}")
    return _unshuffle(data, _WIDTH[codec])


def _shuffle(data: memoryview, width: int):
    """[a0 a1 b0 b1 ...] -> [a0 b0 ... a1 b1 ...]: byte planes; a tail shorter than `width` stays at the end."""
    if width == 1:
        return data
    body = len(data) - len(data) % width
    planes = np.frombuffer(data[:body], dtype=np.uint8).reshape(-1, width).T
    return np.concatenate([planes.reshape(-1), np.frombuffer(data[body:], dtype=np.uint8)]).tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    if width == 1:
        return data
    body = len(data) - len(data) % width
    planes = np.frombuffer(data, dtype=np.uint8, count=body).reshape(width, -1).T
    return planes.tobytes() + data[body:]
