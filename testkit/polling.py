"""Polling with a deadline: what the tests and the lab wait on (a server answering, a cluster formed) instead of a
sleep. The poll interval is short; a condition that never holds fails with what was awaited."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition",
             interval_s: float = 0.01) -> None:
    """Poll until `condition()` is true; fail after timeout_s. The poll interval is short: this is not a sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
