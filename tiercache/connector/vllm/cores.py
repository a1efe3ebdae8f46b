"""Keeping the connector's threads off the cores a CPU engine computes on.

vLLM's CPU backend binds each worker's compute threads (its main thread and OpenMP's) to cores, and a thread inherits
the binding of the thread that starts it. Every thread the connector starts in a worker after that, and every thread
a library starts on its behalf, would take its CPU time from the forward pass: the fetching, gathering and putting
threads, and gRPC's own (its event engine, timer and lifeguard threads, born when the process opens its first
channel). So they are started from a thread moved to the machine's other cores. On a worker bound to nothing (GPU
workers, a process that sets no binding) nothing moves.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def off_compute_cores() -> Callable[[], None] | None:
    """A thread initializer that moves a thread off the cores the calling thread is bound to, or None when it is
    bound to every core there is (or the platform has no affinity calls)."""
    try:
        bound = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - bound
    except (AttributeError, OSError):
        return None
    if not others:
        return None

    def move() -> None:
        try:
            os.sched_setaffinity(0, others)
        except OSError:  # a cpuset that excludes them: stay where vLLM put us
            pass
    return move


def born_off_compute_cores(make: Callable[[], T]) -> T:
    """`make()`, called on a thread moved off the compute cores, so that the threads it starts (gRPC's, when it opens
    the process's first channel) are born there; called here when nothing is bound."""
    move = off_compute_cores()
    if move is None:
        return make()
    made: list = []

    def run() -> None:
        move()
        try:
            made.append((True, make()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            made.append((False, exc))

    thread = threading.Thread(target=run, name="tiercache-connect", daemon=True)
    thread.start()
    thread.join()
    ok, result = made[0]
    if not ok:
        raise result
    return result
