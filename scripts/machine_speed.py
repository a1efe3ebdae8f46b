"""Prints how long a fixed single-core loop takes here, best of three: the same CI suites took 1,864 to 3,497 s from
one fresh-clone run to the next on this machine (docs/runs/ci-time-2026-11-29-42b4502), and a suite's time means
little without the machine's speed beside it. It says when the CPU itself is slow, not everything that slows a run
(that folder's README: the engine suites' CPU time moved where this loop did not). .ci/run prints it before its
suites start and after they end (both with the machine otherwise quiet)."""

from __future__ import annotations

import sys
import time


def loop() -> float:
    started = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i * i % 7
    return time.perf_counter() - started


if __name__ == "__main__":
    label = sys.argv[1] if len(sys.argv) > 1 else "now"
    print(f"ci: this machine's speed ({label}): a fixed single-core loop took {min(loop() for _ in range(3)):.2f} s "
          f"(best of 3)")
