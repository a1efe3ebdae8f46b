"""What the tier answers vLLM's scheduler for a key, without ever waiting on the server.

vLLM's tiering manager asks a secondary tier about each chunk key of a request on the scheduler's thread, every step
until the request is scheduled (`lookup`: HIT, MISS or RETRY). A round trip per key there would stall every request
in the engine, so:
- a key seen for the first time is queued for a background thread that asks the server in batches (Exists), and the
  lookup answers RETRY; vLLM keeps scanning the request's keys on RETRY, so one step queues them all;
- an answer is kept while a request that asked for it is alive (vLLM asks again every step until it schedules); a
  request that comes later shares a HIT, but asks again about a MISS older than the deadline (requests that
  overlap without end on a hot prefix would otherwise keep a miss from an outage, or from before another engine
  stored the key, for ever);
- a key the server has not answered for within the deadline (down, slow, stopped) is a MISS;
- a key whose load failed (evicted after the lookup, a checksum mismatch, the server gone) is a MISS until this tier
  stores it again, or for FAILED_KEY_S (another engine may store it again): vLLM drops a key whose promotion failed
  and asks again, and a tier that answered HIT again would have it promote, fail and defer the request forever
  (vLLM's own fs tier keeps such a negative answer too).
tests/vllm/test_tier.py drives these through vLLM's own tiering manager.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

log = logging.getLogger(__name__)

_BATCH_KEYS = 4096
FAILED_KEY_S = 60.0


class Verdict(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass
class _Entry:
    asked_at: float
    present: bool | None = None  # None: not answered yet
    requests: set[str] = field(default_factory=set)
    answered_at: float = 0.0


@dataclass
class LookupCounts:
    asked: int = 0  # keys sent to the server
    present: int = 0  # of those, the server holds
    timed_out: int = 0  # keys answered MISS because the server did not answer in time
    failed_calls: int = 0  # Exists calls that failed (each key a MISS)


class Verdicts:
    """`exists(keys)` asks the server (on this object's thread); `deadline_s` as TierSettings.lookup_deadline_s."""

    def __init__(self, exists: Callable[[Sequence[bytes]], list[bool]], deadline_s: float) -> None:
        self._exists = exists
        self._deadline_s = deadline_s
        self._entries: dict[bytes, _Entry] = {}
        self._failed: dict[bytes, float] = {}  # key -> when its load failed
        self._by_request: dict[str, set[bytes]] = {}
        self._queued: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.counts = LookupCounts()
        self._thread = threading.Thread(target=self._answer_loop, name="tiercache-tier-lookups", daemon=True)
        self._thread.start()

    def lookup(self, key: bytes, request: str) -> Verdict:
        now = time.monotonic()
        with self._lock:
            failed_at = self._failed.get(key)
            if failed_at is not None:
                if now - failed_at < FAILED_KEY_S:
                    return Verdict.MISS
                del self._failed[key]
            entry = self._entries.get(key)
            if entry is None or (entry.present is False and request not in entry.requests
                                 and now - entry.answered_at >= self._deadline_s):
                entry = self._entries[key] = _Entry(now, requests=entry.requests if entry else set())
                self._queued.append(key)
                self._wake.notify()
            entry.requests.add(request)
            self._by_request.setdefault(request, set()).add(key)
            if entry.present is None:
                if now - entry.asked_at < self._deadline_s:
                    return Verdict.RETRY
                entry.present, entry.answered_at = False, now
                self.counts.timed_out += 1
            return Verdict.HIT if entry.present else Verdict.MISS

    def request_finished(self, request: str) -> None:
        """Forget the answers only this request held: a later request asks the server again."""
        with self._lock:
            for key in self._by_request.pop(request, ()):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.requests.discard(request)
                if not entry.requests and entry.present is not None:
                    del self._entries[key]

    def load_failed(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            for stale in [k for k, at in self._failed.items() if now - at >= FAILED_KEY_S]:
                del self._failed[stale]
            self._failed.update(dict.fromkeys(keys, now))
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.present, entry.answered_at = False, now

    def stored(self, keys: Sequence[bytes]) -> None:
        """This tier stored `keys`: a load that failed before may succeed now, and a lookup need not ask."""
        with self._lock:
            for key in keys:
                self._failed.pop(key, None)
                entry = self._entries.get(key)
                if entry is not None:
                    entry.present = True

    def known_present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the server was last seen holding it (a store may skip it)."""
        with self._lock:
            return [key not in self._failed and getattr(self._entries.get(key), "present", None) is True
                    for key in keys]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def _answer_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch, self._queued = self._queued[:_BATCH_KEYS], self._queued[_BATCH_KEYS:]
            present = self._ask(batch)
            with self._lock:
                self.counts.asked += len(batch)
                self.counts.present += sum(present)
                for key, held in zip(batch, present):
                    entry = self._entries.get(key)
                    if entry is None or entry.present is not None:
                        continue
                    entry.present, entry.answered_at = held, time.monotonic()
                    if not entry.requests:  # every request that asked ended before the answer
                        del self._entries[key]

    def _ask(self, keys: list[bytes]) -> list[bool]:
        try:
            return list(self._exists(keys))
        except Exception as exc:  # noqa: BLE001 - whatever the server or the channel says, the keys are misses
            with self._lock:
                self.counts.failed_calls += 1
            log.debug("tiercache tier: a lookup of %d keys failed (%s): misses", len(keys), exc)
            return [False] * len(keys)
