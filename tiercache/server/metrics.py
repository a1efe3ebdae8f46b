"""Prometheus metrics: store figures read at scrape time, and RPC latency histograms.

Each server owns its registry (no global state), so several servers can live in one process (the tests do).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiercache import __version__
from tiercache.prefix.delivered import DROP_REASONS
from tiercache.server.build_info import build_commit
from tiercache.server.limits import StreamLimits
from tiercache.store.stats import StoreStats
from tiercache.store.tiered import TieredStore

# Labels Prometheus sets on every series from the target it scraped (job, instance, and the Kubernetes ones a
# ServiceMonitor adds): a metric's own label of one of these names is renamed exported_<name>, so none of ours has one.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "container", "endpoint"})

# name, help, attribute of TierStats; counters get the `_total` suffix from prometheus_client.
_TIER_COUNTERS = (
    ("tiercache_tier_hits", "Reads served by this tier", "hits"),
    ("tiercache_tier_misses", "Reads this tier could not serve", "misses"),
    ("tiercache_tier_evictions", "Chunks evicted from this tier", "evictions"),
    ("tiercache_tier_promotions", "Chunks promoted out of this tier to a faster one", "promotions"),
    ("tiercache_tier_demotions", "Chunks demoted into this tier from a faster one", "demotions"),
    ("tiercache_tier_checksum_failures", "Records that failed their checksum and were dropped", "checksum_failures"),
    ("tiercache_tier_errors", "Calls that failed because the tier was down or refused", "errors"),
)
_TIER_GAUGES = (
    ("tiercache_tier_used_bytes", "Bytes held by this tier", "used_bytes"),
    ("tiercache_tier_capacity_bytes", "Capacity of this tier (0: bounded by the backend)", "capacity_bytes"),
    ("tiercache_tier_chunks", "Chunks held by this tier", "chunks"),
    ("tiercache_tier_state_bytes", "Bytes of recurrent-state checkpoints held by this tier", "state_bytes"),
    ("tiercache_tier_state_budget_bytes", "State byte budget of this tier (0: none of its own)", "state_budget_bytes"),
    ("tiercache_tier_state_chunks", "Recurrent-state checkpoints held by this tier", "state_chunks"),
)


class StoreCollector:
    """Reads `store.stats()` at every scrape, so the metrics can never drift from what `tiercache stats` shows."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()
        for name, doc, attr in _TIER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], getattr(tier, attr))
            yield family
        for name, doc, attr in _TIER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], getattr(tier, attr))
            yield family
        up = GaugeMetricFamily("tiercache_tier_up", "1 when the tier's backend is reachable", labels=["tier"])
        for tier in stats.tiers:
            up.add_metric([tier.name], 1 if tier.up else 0)
        yield up
        yield from _lookup_families(stats)
        yield from _delivery_families(stats)
        # Not `namespace`: Prometheus gives every scraped series its target's Kubernetes namespace under that name and
        # renames ours to exported_namespace (TARGET_LABELS; tests/server/test_metrics_labels.py).
        used = GaugeMetricFamily("tiercache_namespace_used_bytes", "Bytes held in local tiers per cache namespace",
                                 labels=["cache_namespace"])
        for ns in stats.namespaces:
            used.add_metric([ns.namespace], ns.used_bytes)
        yield used


def _lookup_families(stats: StoreStats) -> Iterator[Metric]:
    """What lookups found: a promise, which includes the prefix the engine holds itself (_delivery_families counts
    what engines loaded)."""
    lookups = stats.lookups
    yield CounterMetricFamily("tiercache_lookups", "Prefix lookups connectors made", value=lookups.lookups)
    yield CounterMetricFamily("tiercache_lookup_requested_tokens", "Prompt tokens of those lookups",
                              value=lookups.requested_tokens)
    yield _by_tier("tiercache_lookup_found_tokens", "Prompt tokens lookups found restorable, by tier (includes what "
                   "the engine held itself: tiercache_delivered_tokens counts what it loaded)", stats,
                   lookups.found_tokens_by_tier)


def _by_tier(name: str, doc: str, stats: StoreStats, counts: dict[str, int]) -> Metric:
    """A counter by tier with every tier from the start, at 0 until something counts there: a family without samples
    is no series at all, so a dashboard or a `rate()` had nothing to show (and nothing to tell "none" from "not
    scraped"; tests/server/test_stats_log.py)."""
    family = CounterMetricFamily(name, doc, labels=["tier"])
    for tier, n in sorted(({t.name: 0 for t in stats.tiers} | dict(counts)).items()):
        family.add_metric([tier], n)
    return family


def _delivery_families(stats: StoreStats) -> Iterator[Metric]:
    """What engines did with tiercache's bytes, as their connectors report it (ReportDelivery)."""
    delivered = stats.delivered
    yield _by_tier("tiercache_delivered_tokens", "Prompt tokens engines loaded from tiercache beyond their own prefix "
                   "cache's hit, by tier", stats, delivered.loaded_tokens_by_tier)
    yield CounterMetricFamily("tiercache_delivered_loads", "Loads engines completed", value=delivered.loads)
    yield CounterMetricFamily("tiercache_failed_loads", "Loads that failed (the engine recomputed the tokens)",
                              value=delivered.failed_loads)
    yield CounterMetricFamily("tiercache_failed_load_tokens", "Prompt tokens of loads that failed",
                              value=delivered.failed_load_tokens)
    dropped = CounterMetricFamily("tiercache_saves_dropped",
                                  "Objects engines saved that never reached a server, by reason (reported once the "
                                  "server answers again)", labels=["reason"])
    for reason in DROP_REASONS:
        dropped.add_metric([reason], delivered.saves_dropped_by_reason.get(reason, 0))
    yield dropped


class RequestsCollector:
    """Requests in flight per tenant (gRPC Put/Get streams and data-channel requests: what
    server.max_streams_per_tenant bounds). Per tenant, not per peer host: hosts come and go, tenants are configured."""

    def __init__(self, limits: StreamLimits, tenants: list[str]) -> None:
        self._limits = limits
        self._tenants = tenants  # a series for each from the start, at 0 while it has nothing in flight

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("tiercache_requests_in_flight",
                                   "Put/Get streams and data-channel requests being served", labels=["tenant"])
        held = {name: 0 for name in self._tenants} | self._limits.tenants.snapshot()
        for tenant, n in sorted(held.items()):
            family.add_metric([tenant], n)
        yield family


class Metrics:
    def __init__(self, store: TieredStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        ProcessCollector(registry=self.registry)  # process_* (CPU, memory, open files), as dashboards expect
        info = Gauge("tiercache_build_info", "Always 1: the server's version and the commit it was built from",
                     ["version", "commit"], registry=self.registry)
        info.labels(__version__, build_commit()).set(1)
        self.rpc_seconds = Histogram(
            "tiercache_rpc_duration_seconds", "Server-side RPC latency", ["method", "code"], registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self._http = None

    def watch_requests(self, limits: StreamLimits, tenants: list[str]) -> None:
        self.registry.register(RequestsCollector(limits, tenants))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (useful with port 0)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
