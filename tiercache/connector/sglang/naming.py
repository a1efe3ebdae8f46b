"""Where SGLang's pages live in tiercache: namespaces and keys.

SGLang names a page by a 64-hex SHA-256 chained over the tokens from the prompt's start (seeded by the request's
namespace or cache salt), and nothing else: not the model, not the rank, not the layout of the bytes. Everything
that changes the bytes therefore goes into our namespace — the model, tensor / pipeline / context-parallel rank and
size (the rank is left out for MLA's KV, which every rank holds whole, as SGLang's own file backend does), the host
pool's class, layout, page size, dtype and page bytes, and how the pages are encoded (SGLang's flat pages, or the
zero-copy v1 regions) — and the tenant's salt suffix when a salt is set. The namespace shows the model's name and a
digest of the rest, so it stays within the namespace limit however long the name.

A pool beside the KV pool (Mamba states, SWA windows) keeps its objects in the KV namespace when it is sharded like
the KV (so a state can name its page's KV as its parent, and eviction takes the state first); its key is the page's
key plus a digest of the pool's name and layout.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import xxhash

from tiercache.record.keys import MAX_NAMESPACE_CHARS, salt_suffix

_MODEL_CHARS = 96


def page_key(sglang_key: str) -> bytes:
    """The 32 bytes of SGLang's 64-hex page hash; any other string is hashed to 32 bytes."""
    if len(sglang_key) == 64:
        try:
            return bytes.fromhex(sglang_key)
        except ValueError:
            pass
    return hashlib.sha256(sglang_key.encode()).digest()


def component_key(page: bytes, pool_digest: bytes) -> bytes:
    """A page's object in a pool beside the KV pool: the page's key and the pool's digest (pool_digest())."""
    return page + pool_digest


def pool_digest(pool_name: str, layout: Mapping[str, Any]) -> bytes:
    return xxhash.xxh3_64_digest(json.dumps({"pool": pool_name, **layout}, sort_keys=True).encode())


def ranks(config, *, replicated: bool) -> dict[str, int]:
    """The parallel ranks a pool's bytes depend on (HiCacheStorageConfig fields); `replicated`: every tensor-parallel
    rank holds the same bytes (MLA's KV), so its TP rank and size are not part of the name."""
    names = ["pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "dcp_rank", "dcp_size"]
    if not replicated:
        names = ["tp_rank", "tp_size", *names]
    return {name: int(getattr(config, name, 0) or 0) for name in names}


def namespace(model: str, identity: Mapping[str, Any], salt: str = "") -> str:
    """`sglang/<model>@<digest of identity>`, plus the salt's suffix."""
    digest = xxhash.xxh3_128_hexdigest(json.dumps(identity, sort_keys=True, default=str).encode())
    model = "".join(c if c.isprintable() and c != "@" else "_" for c in model)[:_MODEL_CHARS]
    name = f"sglang/{model}@{digest}" + (salt_suffix(salt) if salt else "")
    assert len(name) <= MAX_NAMESPACE_CHARS
    return name


def pool_layout(pool) -> dict[str, Any]:
    """What of a host pool decides its pages' bytes (SGLang's HostKVCache and its subclasses; read defensively: a
    pool class may lack a field)."""
    layout: dict[str, Any] = {"class": type(pool).__name__}
    for name in ("layout", "page_size", "dtype", "layer_num", "head_num", "head_dim", "kv_lora_rank",
                 "qk_rope_head_dim", "size_per_token", "start_layer", "end_layer"):
        value = getattr(pool, name, None)
        if value is not None:
            layout[name] = str(value) if not isinstance(value, (int, float, str, bool)) else value
    return layout
