"""Reading Prometheus text format, as the servers the lab starts expose it (vLLM's /metrics, tiercache's)."""

from __future__ import annotations

import re
import urllib.request


def prometheus_by_label(text: str, metric: str, label: str) -> dict[str, float]:
    """A metric's samples summed per value of one label (Prometheus text format)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            labels, value = line[len(metric) + 1:].rsplit("} ", 1)
            match = re.search(rf'(?:^|,){label}="([^"]*)"', labels)
            key = match.group(1) if match else ""
            found[key] = found.get(key, 0.0) + float(value)
    return found


def prometheus_sum(text: str, metric: str) -> float:
    """The sum of a metric's samples over every label set in Prometheus text format (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()
