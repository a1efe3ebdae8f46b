"""A vLLM worker's counters, as vLLM logs them (its KV-transfer line) and as the tests read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerStats:
    """Loads count their own fields, saves theirs (each under its own lock). Every object that never reached a
    server is counted, in `saves_dropped` and by why (tiercache.prefix.delivered's reasons)."""

    loads_done: int = 0
    loads_failed: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    objects_saved: int = 0
    saves_dropped: int = 0
    saves_dropped_backlog: int = 0
    saves_dropped_unreachable: int = 0
    saves_dropped_refused: int = 0
    saves_dropped_error: int = 0
    saves_dropped_shutdown: int = 0
