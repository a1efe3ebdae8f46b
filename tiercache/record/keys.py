"""The one key type of the store, and the rules for what makes a valid key or namespace."""

from __future__ import annotations

from typing import NamedTuple

import xxhash

from tiercache.errors import InvalidArgument

MAX_KEY_BYTES = 64
MAX_NAMESPACE_CHARS = 256


class ChunkKey(NamedTuple):
    """Where a chunk lives: its namespace (what may share bytes) and its key within it (opaque bytes).

    Construction does not validate (a 262,144-token lookup makes ~2,000 keys per request, and per-key validation
    was 3 us of the 5 us each cost): inputs from outside are checked with `ChunkKey.checked` at the boundary.
    """

    namespace: str
    key: bytes

    @classmethod
    def checked(cls, namespace: object, key: object) -> "ChunkKey":
        return cls(validate_namespace(namespace), validate_key(key))

    @property
    def digest(self) -> str:
        """32 hex characters naming the pair, stable across processes; used for file names and Redis keys."""
        return xxhash.xxh3_128_hexdigest(self.namespace.encode() + b"\x00" + self.key)

    def __repr__(self) -> str:
        return f"ChunkKey({self.namespace!r}, {self.key.hex()})"


def salt_suffix(salt: str) -> str:
    """What a tenant salt adds to a namespace: '~' and a digest, so the salt itself never travels or gets logged.

    The server's tenant table (tiercache.server.auth) checks namespaces against the same suffix.
    """
    return "~" + xxhash.xxh3_64_hexdigest(salt.encode())


def validate_namespace(namespace: object) -> str:
    if not isinstance(namespace, str):
        raise InvalidArgument(f"namespace must be a string, got {type(namespace).__name__}")
    if not 1 <= len(namespace) <= MAX_NAMESPACE_CHARS:
        raise InvalidArgument(f"namespace must be 1..{MAX_NAMESPACE_CHARS} characters, got {len(namespace)}")
    if not namespace.isprintable():
        raise InvalidArgument("namespace must contain printable characters only")
    return namespace


def validate_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise InvalidArgument(f"key must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key
