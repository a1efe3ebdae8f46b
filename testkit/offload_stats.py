"""What an engine with vLLM's own offloading says it did: vLLM's counters (its Prometheus snapshot: the prompt tokens
each source served, the tiering manager's per-tier counters and lookup delays) and each secondary tier's own counts
(TierCacheTier.counts). Runs in the engine's process (testkit/vllm_engine_process.py)."""

from __future__ import annotations

COUNTERS = ("vllm:prompt_tokens_cached_by_source", "vllm:kv_offload_tiering_chunk_hits",
            "vllm:kv_offload_tiering_chunk_queries", "vllm:kv_offload_tiering_promotion_job_failures",
            "vllm:kv_offload_tiering_cascade_job_failures", "vllm:kv_offload_tiering_read_bytes",
            "vllm:kv_offload_tiering_write_bytes", "vllm:external_prefix_cache_hits")
HISTOGRAMS = ("vllm:kv_offload_tiering_lookup_sync_delay_seconds",)


def offload_stats(llm) -> dict:
    counters: dict[str, dict[str, float]] = {}
    delays: dict[str, dict] = {}
    for metric in llm.get_metrics():
        label = metric.labels.get("source") or metric.labels.get("tier") or ""
        if metric.name in COUNTERS:
            counters.setdefault(metric.name, {})[label] = counters.get(metric.name, {}).get(label, 0) + metric.value
        elif metric.name in HISTOGRAMS:
            delays[label] = {"count": metric.count, "sum": metric.sum, "buckets": dict(metric.buckets)}
    return {"counters": counters, "lookup_sync_delay": delays, "tiers": _tier_counts(llm)}


def _tier_counts(llm) -> list[dict]:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    manager = connector.connector_scheduler.manager
    return [{"type": tier.tier_type, **(tier.counts() if hasattr(tier, "counts") else {})}
            for tier in getattr(manager, "secondary_tiers", [])]
