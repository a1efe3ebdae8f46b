"""The Grafana dashboard only references metrics, and labels, that a running server really exports (scraped from
/metrics)."""

from __future__ import annotations

import json
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT
from tiercache.client import Client
from tiercache.prefix.delivered import Delivered

DASHBOARD = ROOT / "deploy" / "base" / "grafana-dashboard.json"


def test_dashboard_metrics_exist(start_server):
    server = start_server(metrics_port=0)
    with Client.from_url(server.url) as client:  # one of everything, so every family has samples
        client.put("ns", b"k", b"x")
        client.get("ns", b"k")
        client.report_delivery("ns", Delivered(1, {"host": 9}))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    expressions = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    referenced = {name for e in expressions for name in re.findall(r"\btiercache_[a-z_]+", e)}
    assert referenced, "the dashboard references no metric"
    missing = sorted(name for name in referenced if name not in exported)
    assert missing == [], f"dashboard metrics the server does not export: {missing}"
    # Labels too: a renamed label (namespace -> cache_namespace, tests/server/test_metrics_labels.py) left behind in a
    # `by (...)` or a selector would make a panel show one unlabelled series, or nothing, without any error.
    labels = {label for family in text_string_to_metric_families(text) for sample in family.samples
              for label in sample.labels}
    used = {label.strip() for e in expressions
            for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", e) for label in group.split(",")}
    used |= {label for e in expressions for selector in re.findall(r"\{([^}]*)\}", e)
             for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector)}
    assert used, "the dashboard groups by no label"
    assert sorted(used - labels - {""}) == [], "dashboard labels the server does not export"
