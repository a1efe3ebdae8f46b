"""The Grafana dashboard only references metrics a running server really exports (scraped from /metrics)."""

from __future__ import annotations

import json
import re
import urllib.request

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
