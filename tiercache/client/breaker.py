"""A circuit breaker: while the server cannot be reached, calls fail at once instead of each waiting for a deadline.

An engine asks the cache on its scheduler thread. Without a breaker a dead server costs every request the retries
(~0.7 s), and a hung one (the TCP connection accepted, nothing answered) the whole deadline. With one:
- *closed*: calls go through. A call that could not reach the server (ConnectionBroken: the server down, or a
  deadline passed: hung) opens it;
- *open*: every call raises CircuitOpen at once, and a background thread probes the server under a short deadline
  (the client's probe is a Stats call: it goes through the store's threads, so a server whose event loop answers but
  whose store is stuck stays "down"), spaced by the policy's backoff (tiercache.backoff); the first answer closes
  it. So after the first failure an outage costs nothing per call, and the first call after recovery goes
  through.
The breaker logs once when it opens and once when it closes: an outage is not one warning per request.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from tiercache.backoff import Backoff
from tiercache.errors import CircuitOpen

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerPolicy:
    probe_timeout_s: float = 0.25  # a probe unanswered by then counts as failed
    probe_backoff: Backoff = Backoff(first_s=0.05, max_s=2.0)  # the waits before each probe while it is open

    @classmethod
    def probing_at_most(cls, interval_s: float) -> "BreakerPolicy":
        """The default policy with probes at most `interval_s` apart (the connectors' `offline_backoff_s`)."""
        first_s = cls.probe_backoff.first_s
        return cls(probe_backoff=Backoff(min(first_s, interval_s), interval_s))


class CircuitBreaker:
    """`probe(timeout_s)` answers whether the server is serving (it must not raise)."""

    def __init__(self, probe: Callable[[float], bool], policy: BreakerPolicy, name: str) -> None:
        self._probe = probe
        self.policy = policy
        self.name = name
        self._open = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._prober: threading.Thread | None = None
        self.opened = 0  # how many times it opened
        self.probes = 0  # probes sent while open

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def refuse(self) -> None:
        """Raise CircuitOpen while open; called before every call."""
        if self._open.is_set():
            raise CircuitOpen(f"{self.name} did not answer recently; not asking until a probe is answered")

    def trip(self, reason: BaseException) -> None:
        """A call could not reach the server: open, and probe in the background until it answers."""
        with self._lock:
            if self._open.is_set() or self._stopped.is_set():
                return
            self._open.set()
            self.opened += 1
            self._prober = threading.Thread(target=self._probe_until_serving, name="tiercache-breaker", daemon=True)
            self._prober.start()
        log.warning("tiercache server %s unreachable (%s): calls fail at once until it answers a probe",
                    self.name, reason)

    def close(self) -> None:
        """Stop probing (the client is closing)."""
        self._stopped.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join()

    def _probe_until_serving(self) -> None:
        try:
            for delay in self.policy.probe_backoff.delays():
                if self._stopped.wait(delay):
                    return
                self.probes += 1
                try:
                    serving = self._probe(self.policy.probe_timeout_s)
                except Exception:  # noqa: BLE001 - a probe that cannot even be sent is a failed probe
                    serving = False
                if serving:
                    log.warning("tiercache server %s answers again", self.name)
                    return
        finally:
            self._open.clear()  # closed when serving, or when the client closes: never open with nobody probing
