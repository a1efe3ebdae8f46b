"""The tier's server namespace: every fact that decides what a chunk's bytes mean, so that only engines whose slots
hold the same bytes for the same key share them.

A key is vLLM's block hash and group index; a slot is one row of vLLM's CPU pool (every worker's pages of one chunk
of one group, laid out by vLLM). So the namespace names:
- the model and flags vLLM does not tell a tier (`model_identity`, from `tiercache vllm-tier`: weights,
  quantization, KV cache dtype, config overrides such as RoPE scaling) and the model dtype it does;
- how keys are made: the seed block hashes chain from (vLLM's NONE_HASH, which also differs per hash algorithm; with
  a non-cryptographic hash and no PYTHONHASHSEED it is random per process, and nothing is shared), tokens per hash,
  blocks per chunk;
- how slots are laid out: the groups (block size, layer names), bytes per block and per row, the parallel layout
  (every rank's pages are in one row), vLLM's layout flags, vLLM's version, the platform (and on the CPU the
  capabilities its attention kernel lays pages out by: connector.vllm.identity), an attention backend named on
  vLLM's command line;
- the salt, as the connector adds it (tenants may require one).
"""

from __future__ import annotations

import logging
import os

import xxhash

from tiercache.connector.vllm.identity import cpu_capabilities, runtime_identity
from tiercache.record.keys import salt_suffix

log = logging.getLogger(__name__)


def identity_text(config, model_identity: str, row_bytes: int, attention_backend: str = "") -> str:
    """The canonical text of an OffloadingConfig (vLLM 0.32 or 0.33) and the tier's model identity: the runtime as
    the connector names it (identity.runtime_identity), then how keys are made and slots laid out."""
    groups = "|".join(f"{g.group_id}:{g.tokens_per_block}:{','.join(g.layer_names)}" for g in config.groups)
    parallel = config.parallel
    runtime = runtime_identity(model_identity, config.model.dtype, attention_backend or "auto",
                               platform_key="platform", cpu_device=cpu_capabilities)
    return ";".join([
        *runtime,
        f"seed={_seed_digest()}", f"tokens_per_hash={config.cache.tokens_per_hash}",
        f"blocks_per_chunk={config.cache.blocks_per_chunk}", f"groups={groups}",
        f"block_bytes={config.worker_kv_bytes_per_block}", f"row_bytes={row_bytes}",
        f"parallel={parallel.world_size},{parallel.tp_size},{parallel.pp_size},{parallel.pcp_size},"
        f"{parallel.dcp_size},{parallel.is_parallelism_agnostic}",
        f"layout={config.replicated_layout},{config.canonical_layout},{config.kv_cache_layout}"])


def namespace(config, model_identity: str, row_bytes: int, salt: str = "", attention_backend: str = "") -> str:
    """model-name@vllm-tier#digest[~salt digest]."""
    name = os.path.basename(str(config.model.name).rstrip("/"))[:96] or "model"
    digest = xxhash.xxh3_128_hexdigest(identity_text(config, model_identity, row_bytes, attention_backend).encode())
    return f"{name}@vllm-tier#{digest}" + (salt_suffix(salt) if salt else "")


def _seed_digest() -> str:
    """A digest of the NONE_HASH the engine's block hashes chain from (set by the engine core before its first
    request, after the tier is made: so the namespace is resolved on first use)."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        raise RuntimeError("vLLM has not set the block hashes' seed (NONE_HASH) yet")
    if _seed_is_random(kv_cache_utils):
        log.warning("TierCacheTier: vLLM seeds this engine's block hashes at random (a non-cryptographic "
                    "--prefix-caching-hash-algo without PYTHONHASHSEED): no other engine and no restart will find "
                    "what it stores. Set PYTHONHASHSEED to one value on every engine, or keep the default sha256")
    return xxhash.xxh3_64_hexdigest(bytes(none_hash))


def _seed_is_random(kv_cache_utils) -> bool:
    seed = getattr(kv_cache_utils, "get_none_hash_seed", lambda: None)()
    default = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)
    return seed is not None and seed != default and seed != os.getenv("PYTHONHASHSEED")
