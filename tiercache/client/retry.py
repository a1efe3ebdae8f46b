"""How the client tries a call again. Every call is idempotent (a put of the same key and bytes leaves the same state),
so any call may be retried; which failures are is their category's business (tiercache.errors: Unavailable)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Iterator

from tiercache.backoff import Backoff


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all, waiting by `backoff` between them (all inside the call's deadline)."""

    attempts: int = 4
    backoff: Backoff = Backoff(first_s=0.05, max_s=1.0)

    def delays(self) -> Iterator[float]:
        return islice(self.backoff.delays(), max(self.attempts - 1, 0))
