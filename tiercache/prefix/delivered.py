"""What an engine did with tiercache's bytes, as its connector counts it and the server totals it: the hits tiercache
delivered (tokens loaded beyond the engine's own prefix-cache hit), the loads that failed, and the saves that never
reached a server. A lookup's answer is a promise; these are what happened (tiercache.store.reports keeps both apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tiercache.errors import InvalidArgument

# Why a saved object never reached a server (Delivered.saves_dropped_by_reason).
DROPPED_BACKLOG = "backlog"  # more than max_pending_save_bytes were waiting to be sent
DROPPED_UNREACHABLE = "unreachable"  # the server did not answer (or the client's breaker was open)
DROPPED_REFUSED = "refused"  # the server refused the bytes (capacity, quota, size)
DROPPED_ERROR = "error"  # copying the bytes out of the engine failed
DROPPED_SHUTDOWN = "shutdown"  # still waiting when the engine stopped
DROP_REASONS = (DROPPED_BACKLOG, DROPPED_UNREACHABLE, DROPPED_REFUSED, DROPPED_ERROR, DROPPED_SHUTDOWN)


@dataclass(frozen=True)
class Delivered:
    """What engines did with tiercache's bytes, as their connectors report it (ReportDelivery): loads completed and
    the tokens they gave the engine beyond its own prefix cache's hit (by tier), loads that failed (the engine
    recomputed), and saved objects that never reached a server, by reason."""

    loads: int = 0
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    failed_loads: int = 0
    failed_load_tokens: int = 0
    saves_dropped_by_reason: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: "Delivered") -> "Delivered":
        return Delivered(self.loads + other.loads,
                         summed_counts(self.loaded_tokens_by_tier, other.loaded_tokens_by_tier),
                         self.failed_loads + other.failed_loads, self.failed_load_tokens + other.failed_load_tokens,
                         summed_counts(self.saves_dropped_by_reason, other.saves_dropped_by_reason))

    @property
    def loaded_tokens(self) -> int:
        return sum(self.loaded_tokens_by_tier.values())

    @property
    def saves_dropped(self) -> int:
        return sum(self.saves_dropped_by_reason.values())

    def checked(self) -> "Delivered":
        """This report, when a server may count it (it comes off the wire): known reasons, a bounded set of tiers."""
        unknown = set(self.saves_dropped_by_reason) - set(DROP_REASONS)
        if unknown:
            raise InvalidArgument(f"unknown reasons for dropped saves: {', '.join(sorted(unknown))} (known: "
                                  f"{', '.join(DROP_REASONS)})")
        if len(self.loaded_tokens_by_tier) > 16 or any(len(tier) > 64 for tier in self.loaded_tokens_by_tier):
            raise InvalidArgument("a delivery names at most 16 tiers of at most 64 characters")
        return self

    def is_empty(self) -> bool:
        return not (self.loads or self.failed_loads or self.loaded_tokens or self.saves_dropped)


def summed_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Two sets of counts by name, added."""
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}
