"""What connectors tell the server about their engines: the lookups they made (what tiercache found for a prompt) and
what their engines then did (the tokens loaded beyond the engine's own prefix-cache hit, loads that failed, saves
that never arrived). The two are kept apart on purpose: a lookup finds the prefix an engine already holds as well,
so only deliveries say what tiercache gave an engine (tests/server/test_delivery.py, tests/vllm's delivery tests).
"""

from __future__ import annotations

import threading

from tiercache.prefix.delivered import Delivered, summed_counts
from tiercache.store.stats import LookupStats


class EngineReports:
    """Running totals, safe to update from the server's handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups = LookupStats()
        self._delivered = Delivered()

    def record_lookup(self, requested_tokens: int, found_tokens_by_tier: dict[str, int]) -> None:
        """Count one lookup the server answered (the hit rule runs in Lookup)."""
        with self._lock:
            found = summed_counts(self._lookups.found_tokens_by_tier, found_tokens_by_tier)
            self._lookups = LookupStats(self._lookups.lookups + 1, self._lookups.requested_tokens + requested_tokens,
                                        found)

    def record_delivery(self, delivered: Delivered) -> None:
        """Add a connector's report of what happened since its last one."""
        with self._lock:
            self._delivered = self._delivered + delivered

    def lookups(self) -> LookupStats:
        with self._lock:
            return self._lookups

    def delivered(self) -> Delivered:
        with self._lock:
            return self._delivered
