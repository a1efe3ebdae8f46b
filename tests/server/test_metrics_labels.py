"""No metric of a running server has a label that Prometheus sets from the target it scrapes (job, instance, and the
Kubernetes labels of a ServiceMonitor: namespace, pod, service, container, endpoint). Prometheus would rename ours to
exported_<name>: a dashboard asking for `namespace` would get the pod's Kubernetes namespace instead of the cache
namespace. So the cache namespace is `cache_namespace` (docs/deploy.md, "Prerequisites")."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.client import Client
from tiercache.prefix.delivered import Delivered
from tiercache.server.metrics import TARGET_LABELS

NS = "team-a/model@main"


def _labels(text: str) -> dict[str, set[str]]:
    """Metric family -> the label names its samples carry, from a /metrics page."""
    return {family.name: {label for sample in family.samples for label in sample.labels}
            for family in text_string_to_metric_families(text)}


def _clashes(text: str) -> dict[str, set[str]]:
    return {name: labels & TARGET_LABELS for name, labels in _labels(text).items() if labels & TARGET_LABELS}


def test_no_metric_has_a_label_prometheus_sets_from_the_target(start_server):
    server = start_server(metrics_port=0)
    with Client.from_url(server.url) as client:  # one of everything, so every family has samples and shows its labels
        client.put(NS, b"k", b"x")
        client.get(NS, b"k")
        client.report_delivery(NS, Delivered(1, {"host": 9}))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    silent = [f.name for f in text_string_to_metric_families(text) if f.name.startswith("tiercache_") and not f.samples]
    assert silent == [], "a family without samples shows no labels to check"
    assert _clashes(text) == {}
    labels = _labels(text)
    assert labels["tiercache_namespace_used_bytes"] == {"cache_namespace"}
    assert f'tiercache_namespace_used_bytes{{cache_namespace="{NS}"}}' in text


def test_the_check_catches_a_namespace_label():
    registry = CollectorRegistry()
    Gauge("tiercache_example_bytes", "a family labelled the way ours was", ["namespace"], registry=registry) \
        .labels("ns").set(1)
    assert _clashes(generate_latest(registry).decode()) == {"tiercache_example_bytes": {"namespace"}}
