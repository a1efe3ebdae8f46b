"""Hybrid-aware prefix caching for transformers models (see `prefill`; `cache` moves KV and states in and out of
transformers' cache objects)."""

from tiercache.connector.hf.prefill import (
                                            CachedPrefill,
                                            Generation,
                                            Options,
                                            Prefill,
                                            continuation_refusal,
                                            weights_digest,
)

__all__ = ["CachedPrefill", "Generation", "Options", "Prefill", "continuation_refusal", "weights_digest"]
