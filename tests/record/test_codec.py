"""Compressed records in the disk and Redis tiers: transparent to readers, checked before decompressing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiercache.config import Config, DiskTierConfig, HostTierConfig, KiB, MiB, RedisTierConfig
from tiercache.errors import ChunkCorrupt, ConfigError
from tiercache.record import codec, encoding
from tiercache.record.keys import ChunkKey
from tiercache.store.tiered import TieredStore


def bf16_like(n_bytes: int, seed: int = 0) -> bytes:
    """Gaussian values as bfloat16 (the high halves of float32): what KV looks like, compressible after a shuffle."""
    values = np.random.default_rng(seed).standard_normal(n_bytes // 2).astype(np.float32)
    return values.view(np.uint16)[1::2].tobytes()


@pytest.mark.parametrize("name", ["lz4", "lz4-shuffle2", "lz4-shuffle4"])
@pytest.mark.parametrize("size", [0, 1, 3, 4095, 64 * KiB + 1])
def test_round_trip(name, size):
    data = os.urandom(size)
    assert codec.decompress(codec.codec_id(name), codec.compress(codec.codec_id(name), data)) == data


def test_shuffle_makes_bf16_compress():
    data = bf16_like(MiB)
    plain = len(codec.compress(codec.LZ4, data))
    shuffled = len(codec.compress(codec.LZ4_SHUFFLE2, data))
    assert shuffled < plain and len(data) / shuffled > 1.1


def test_transcoded_record_decodes_to_the_same_payload_and_catches_corruption():
    key = ChunkKey("ns", b"k")
    payload = bf16_like(256 * KiB)
    raw = encoding.encode(key, payload)
    packed = encoding.transcode(raw, key, codec.LZ4_SHUFFLE2)
    assert len(packed) < len(raw) and encoding.read_header(packed).codec == codec.LZ4_SHUFFLE2
    assert bytes(encoding.decode(packed, key)) == payload
    assert encoding.transcode(packed, key, codec.LZ4_SHUFFLE2) is packed
    assert bytes(encoding.transcode(packed, key, codec.RAW)) == bytes(raw)
    damaged = bytearray(packed)
    damaged[len(damaged) // 2] ^= 0x08
    with pytest.raises(ChunkCorrupt):
        encoding.decode(damaged, key)


def test_store_compresses_on_demotion_and_restores_on_promotion(tmp_path, redis_url):
    store = TieredStore.from_config(Config(
        host=HostTierConfig(capacity_bytes=1 * MiB),
        disk=DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=2 * MiB, codec="lz4-shuffle2"),
        redis=RedisTierConfig(url=redis_url, codec="lz4")))
    payloads = {i: bf16_like(400 * KiB, seed=i) for i in range(12)}
    for i, data in payloads.items():
        store.put(ChunkKey("ns", b"c%d" % i), data)
    where = store.locate([ChunkKey("ns", b"c%d" % i) for i in range(12)])
    assert {"host", "disk", "redis"} <= set(where)
    disk = {t.name: t for t in store.stats().tiers}["disk"]
    assert disk.used_bytes < disk.chunks * 400 * KiB  # stored compressed
    for i, data in payloads.items():  # every tier's copy reads back identical (and moves up, decompressed)
        assert bytes(store.get(ChunkKey("ns", b"c%d" % i)).payload) == data


def test_unknown_codec_is_a_config_error():
    with pytest.raises(ConfigError, match="disk.codec"):
        DiskTierConfig(path="/tmp/x", codec="zstd")
