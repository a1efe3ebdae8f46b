"""Helpers for the tests: tiercache servers on free ports, awaited for readiness, and polling with a deadline.
Redis servers and clusters for the tests are in tests/redis_processes.py."""

from __future__ import annotations

import os
import time
from typing import Callable

from tiercache.process import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port", "python_env", "wait_for"]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition",
             interval_s: float = 0.01) -> None:
    """Poll until `condition()` is true; fail after timeout_s. The poll interval is short: this is not a sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env
