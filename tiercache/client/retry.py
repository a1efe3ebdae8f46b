"""How the client retries UNAVAILABLE: every call is idempotent, so every call may be retried."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class RetryPolicy:
    """How UNAVAILABLE is retried: `attempts` tries in all, sleeping backoff_s, 2*backoff_s, ... up to max_backoff_s."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delays(self) -> Iterator[float]:
        delay = self.backoff_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_backoff_s)
