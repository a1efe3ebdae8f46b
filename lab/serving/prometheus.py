"""Reading Prometheus text format, as the servers the lab starts expose it (vLLM's /metrics, tiercache's)."""

from __future__ import annotations

import re
import sys
import urllib.error
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


def scrape(url: str, timeout_s: float = 30.0, attempts: int = 4) -> str:
    """The page at `url`, asked again after a failed attempt (up to `attempts`), each retry printed to stderr so a
    set's run.log keeps it: one slow answer should not end a set of runs (lab/tests/test_prometheus_scrape.py).
    On a 2-core machine, a tiercache server that shares its core with an engine's spinning compute threads (two
    replicas, one per core) has taken over 30 s to answer a scrape while taking the engines' saves."""
    for attempt in range(1, attempts):
        try:
            return _page(url, timeout_s)
        except (TimeoutError, urllib.error.URLError) as error:
            print(f"scrape of {url} failed ({error!r}), attempt {attempt} of {attempts}; asking again",
                  file=sys.stderr, flush=True)
    return _page(url, timeout_s)


def _page(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return answer.read().decode()
