"""How long to wait after failures in a row: the one schedule behind the client's retries, its circuit breaker's
probes and the Redis tier's reconnection attempts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from tiercache.errors import InvalidArgument


@dataclass(frozen=True)
class Backoff:
    """Waits of first_s, 2*first_s, 4*first_s, ..., never above max_s."""

    first_s: float
    max_s: float

    def __post_init__(self) -> None:
        # A zero wait would make a busy loop of whatever waits (a breaker's prober in an engine's process).
        if not 0 < self.first_s <= self.max_s:
            raise InvalidArgument(f"a backoff needs 0 < first_s <= max_s, got {self.first_s} and {self.max_s}")

    def delays(self) -> Iterator[float]:
        """One wait per failure in a row, endlessly: the caller decides when to give up."""
        delay = self.first_s
        while True:
            yield delay
            delay = min(delay * 2, self.max_s)
