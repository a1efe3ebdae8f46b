"""Chain hashes of token prefixes: what names a prefix, at chunk boundaries and at any position inside a chunk."""

from __future__ import annotations

import array
import functools
import sys

import numpy as np
import xxhash

from tiercache.errors import InvalidArgument

# -- prefix hashing ------------------------------------------------------------------------------------------------
#
# A chain hash names a token prefix: h(0) = H(namespace) and every later hash is H(previous hash || the tokens
# since it), with H = xxh3-128 over token ids as little-endian uint32 — deterministic across processes and machines
# (no hash(), no seeds). The chain has two link sizes:
#   - between chunk boundaries, one link per N tokens:     h(kN) = H(h((k-1)N) || tokens[(k-1)N:kN]);
#   - inside a chunk, one link per match unit u from its start: h(kN + ju) = H(h(kN + (j-1)u) || u tokens);
#   - at any other position p, a *ragged* link from the last multiple of u below p.
# A one-link-per-u chain over the whole prompt (the first design's) costs one Python-level call per 16 tokens:
# 7 ms for 262,144 tokens on our machines. Lookups need hashes only at chunk boundaries and near the prompt's end,
# and N-token links hash 262,144 tokens in ~0.3 ms, with the same meaning: equal hashes <=> equal prefixes.

HASH_BYTES = 16


_UINT32_ARRAY = "I" if array.array("I").itemsize == 4 and sys.byteorder == "little" else None


def token_bytes(tokens) -> bytes:
    """Token ids as the little-endian uint32 bytes the hashes are defined over. Accepts lists and numpy arrays.

    (Engines pass Python lists: array.array converts 262,144 of them in 1.4 ms, numpy with its range checks in 7.5.)"""
    if isinstance(tokens, (list, tuple)) and _UINT32_ARRAY:
        try:
            return array.array(_UINT32_ARRAY, tokens).tobytes()
        except (OverflowError, TypeError):
            raise InvalidArgument("token ids must be integers in 0..2**32-1") from None
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {ids.shape}")
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > 0xFFFFFFFF):
        raise InvalidArgument("token ids must be integers in 0..2**32-1")
    return ids.astype("<u4", copy=False).tobytes()


@functools.lru_cache(maxsize=1024)
def root_hash(namespace: str) -> bytes:
    """h(0) of a namespace: the parent of every first chunk, never stored."""
    return xxhash.xxh3_128_digest(namespace.encode())


class PrefixHashes:
    """Chain hashes of one token sequence. `at(p)` names tokens[0:p]; boundaries are computed up front, the rest
    on demand (and cached per chunk)."""

    def __init__(self, namespace: str, tokens, chunk_tokens: int, u: int) -> None:
        if u <= 0 or chunk_tokens <= 0 or chunk_tokens % u:
            raise InvalidArgument(f"the match unit u={u} must be positive and divide N={chunk_tokens}")
        self.n, self.u = chunk_tokens, u
        self._bytes = token_bytes(tokens)
        self.length = len(self._bytes) // 4
        self._boundaries = _chain(root_hash(namespace), self._bytes, 4 * chunk_tokens)
        self._inside: dict[int, list[bytes]] = {}

    def boundaries(self, deepest: int) -> bytes:
        """h(0), h(N), ..., h(deepest * N) concatenated (what a Lookup request carries)."""
        return b"".join(self._boundaries[:deepest + 1])

    def at(self, p: int) -> bytes:
        if not 0 <= p <= self.length:
            raise InvalidArgument(f"position {p} is outside 0..{self.length}")
        k, offset = divmod(p, self.n)
        if offset == 0:
            return self._boundaries[k]
        chunk = self._inside.get(k)
        if chunk is None:
            start = 4 * k * self.n
            chunk = self._inside[k] = InsideChunk(self._boundaries[k], self._bytes[start:start + 4 * self.n], self.u)
        return chunk.at(offset)

    def chunk_tokens_bytes(self, k: int, end: int) -> bytes:
        """The token bytes of [kN, end): what a Lookup request carries for the prompt's last chunk."""
        return self._bytes[4 * k * self.n:4 * end]


class InsideChunk:
    """Hashes of the positions inside one chunk, from its boundary hash h(kN) and its token bytes: the u-aligned
    links computed once, a ragged link per other position."""

    def __init__(self, boundary: bytes, data: bytes, u: int) -> None:
        self.u = u
        self._data = data
        self._units = _chain(boundary, data, 4 * u)  # [h(kN), h(kN+u), ...] as far as the tokens go

    def at(self, offset: int) -> bytes:
        """h(kN + offset), for 0 <= offset <= the tokens given."""
        if not 0 <= offset <= len(self._data) // 4:
            raise KeyError(offset)
        base = offset - offset % self.u
        h = self._units[base // self.u]
        if base == offset:
            return h
        return xxhash.xxh3_128_digest(h + self._data[4 * base:4 * offset])


def _chain(h0: bytes, data: bytes, step: int) -> list[bytes]:
    """[h0, H(h0 || data[0:step]), ...]: one link per whole `step` bytes of data."""
    digest = xxhash.xxh3_128_digest
    out = [h0]
    append = out.append
    h = h0
    for offset in range(0, len(data) - step + 1, step):
        h = digest(h + data[offset:offset + step])
        append(h)
    return out
