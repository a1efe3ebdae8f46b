"""The server's periodic activity line: every `server.stats_log_interval_s` (60 s; 0 turns it off) in which there was
traffic, one INFO line with what engines loaded from tiercache (beyond their own prefix caches' hits), by tier, and
what their lookups found:

    activity (last 60 s): engines loaded 5,123 of 10,000 prompt tokens (51.2%: host 4,000, disk 1,123) in 9 loads,
    1 load failed; 12 lookups found 8,123 (81.2%, with what the engines held themselves); 40 reads, 95.0% found;
    since start: 340 lookups, 41.0% of prompt tokens loaded

so an operator sees in the log alone whether hits happen (docs/first-deployment.md), without a metrics stack. What
a lookup found is not what tiercache gave: it includes the prefix the engine already held (a prompt repeated in one
engine is found by every lookup and loaded by none). An idle server logs nothing. Traffic is a lookup, a read (a
tier's hits and misses) or a connector's delivery report since the last line.
"""

from __future__ import annotations

import logging
import threading
import time

from tiercache.store.stats import StoreStats
from tiercache.store.tiered import TieredStore

log = logging.getLogger("tiercache.server.activity")


def activity_line(before: StoreStats, after: StoreStats, seconds: float) -> str | None:
    """What changed between two snapshots of the store's counters, as one line; None when nothing was looked up,
    read or reported."""
    lookups = after.lookups.lookups - before.lookups.lookups
    requested = after.lookups.requested_tokens - before.lookups.requested_tokens
    found = sum(after.lookups.found_tokens_by_tier.values()) - sum(before.lookups.found_tokens_by_tier.values())
    loaded = _changed(before.delivered.loaded_tokens_by_tier, after.delivered.loaded_tokens_by_tier)
    loads = after.delivered.loads - before.delivered.loads
    failed = after.delivered.failed_loads - before.delivered.failed_loads
    dropped = after.delivered.saves_dropped - before.delivered.saves_dropped
    reads, reads_found = _reads(before, after)
    if lookups == 0 and reads == 0 and loads == 0 and failed == 0 and dropped == 0:
        return None
    total = sum(loaded.values())
    by_tier = ", ".join(f"{tier} {n:,}" for tier, n in sorted(loaded.items(), key=lambda item: -item[1]) if n)
    line = (f"activity (last {seconds:.0f} s): engines loaded {total:,} of {requested:,} prompt tokens "
            f"({_percent(total, requested)}{': ' + by_tier if by_tier else ''}) in {_count(loads, 'load')}")
    if failed:
        line += f", {_count(failed, 'load')} failed"
    if dropped:
        line += f", {_count(dropped, 'saved object')} dropped"
    line += f"; {_count(lookups, 'lookup')} found {found:,} ({_percent(found, requested)}, with what the engines " \
            f"held themselves)"
    if reads:
        line += f"; {_count(reads, 'read')}, {_percent(reads_found, reads)} found"
    since = after.lookups.requested_tokens
    line += (f"; since start: {_count(after.lookups.lookups, 'lookup')}, "
             f"{_percent(after.delivered.loaded_tokens, since)} of prompt tokens loaded")
    return line


def _changed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: n - before.get(key, 0) for key, n in after.items()}


def _reads(before: StoreStats, after: StoreStats) -> tuple[int, int]:
    """Reads since `before`, and how many found their chunk. A read asks the tiers in order until one has the chunk:
    the first tier counts every read (a hit or a miss), and each read found is a hit in exactly one tier."""
    reads_before = {t.name: t.hits + t.misses for t in before.tiers}
    found_before = {t.name: t.hits for t in before.tiers}
    first = after.tiers[0] if after.tiers else None
    reads = first.hits + first.misses - reads_before.get(first.name, 0) if first else 0
    return reads, sum(t.hits - found_before.get(t.name, 0) for t in after.tiers)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0.0%"


class StatsLog:
    """A daemon thread that writes the activity line every `interval_s`; `stop()` ends it (at once)."""

    def __init__(self, store: TieredStore, interval_s: float) -> None:
        self._store = store
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-stats-log", daemon=True)
        self._first: tuple[StoreStats, float] | None = None

    def start(self) -> "StatsLog":
        """Takes the first snapshot here, in the caller's thread: whatever happens after start() is in a line."""
        self._first = self._snapshot()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _snapshot(self) -> tuple[StoreStats, float] | None:
        try:
            return self._store.stats(), time.monotonic()
        except Exception:  # noqa: BLE001 - a tier's stats failing (Redis down) must not end the line for good
            log.exception("activity line: the store's statistics could not be read")
            return None

    def _run(self) -> None:
        last = self._first
        while not self._stopped.wait(self.interval_s):
            now = self._snapshot()
            if now is None:
                continue
            if last is not None:
                line = activity_line(last[0], now[0], now[1] - last[1])
                if line is not None:
                    log.info("%s", line)
            last = now
