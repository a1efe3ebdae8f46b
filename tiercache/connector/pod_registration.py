"""An engine's registration as a pod for KV events (docs/events.md), kept up across server restarts.

The server keeps registrations in memory: a restarted server publishes nothing for an engine that keeps running until
the engine registers again. The engine learns of it without a call of its own: each of its lookups names its pod, and
the answer says whether the server has it registered (LookupResponse.pod). When one says it does not, the engine
registers again with the same arguments, asking for the ports it had (routers point at them), on a thread of its own:
never on the engine's scheduler thread, which a slow or dead server must not stall.

At most one registration is in flight. A lookup sent before the last registration was answered proves nothing (the
server may have answered it first), so only later ones start another. After a failed try, the next waits for the
backoff's next delay and for a lookup that again finds the pod missing: a server that refuses the pod (another
tenant's pod id, events turned off) costs one call per delay, never one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

from tiercache.client import Backoff  # tiercache.backoff, as the client layer re-exports it to connectors
from tiercache.client.client import PodEndpoints
from tiercache.errors import TierCacheError

log = logging.getLogger(__name__)

RETRY_BACKOFF = Backoff(first_s=1.0, max_s=60.0)


class PodRegistration:
    def __init__(self, pod_id: str, register: Callable[[tuple[int, int] | None], PodEndpoints],
                 backoff: Backoff = RETRY_BACKOFF) -> None:
        """`register(ports)`: one RegisterPod call with the engine's arguments, asking for `ports` (the (PUB, ROUTER)
        ports of the last registration; None at first); raises what the client raises."""
        self.pod_id = pod_id
        self._register = register
        self._backoff = backoff
        self._lock = threading.Lock()
        self._in_flight: threading.Thread | None = None
        self._failures: Iterator[float] | None = None  # the backoff's delays while tries fail in a row
        self._not_before = float("-inf")  # no try before this (time.monotonic()): the backoff after a failure
        self._answered_at = float("-inf")  # when the last registration succeeded
        self._closed = False
        self.endpoints: PodEndpoints | None = None  # the last registration's answer
        self.registered_again = 0  # registrations after a lookup found the pod missing (logs, tests)

    def register(self) -> bool:
        """Register now, on the caller's thread (an engine's start); False, with a warning, when it failed (the
        engine then serves without events until a lookup finds a server that takes the pod)."""
        return self._try(again=False)

    def lost(self, asked_at: float) -> None:
        """A lookup sent at `asked_at` (time.monotonic()) found the pod unregistered: register again in the
        background, unless a registration is in flight, the lookup is older than the last one's answer, or the
        backoff after a failure has not passed. Returns at once."""
        with self._lock:
            if self._closed or self._in_flight is not None or asked_at < self._answered_at \
                    or time.monotonic() < self._not_before:
                return
            self._in_flight = threading.Thread(target=self._again, name="tiercache-register-pod", daemon=True)
            self._in_flight.start()

    @property
    def in_flight(self) -> bool:
        """Whether a background registration is under way."""
        return self._in_flight is not None

    def close(self) -> None:
        """No further registrations (one in flight ends on its own deadline; its answer is dropped)."""
        with self._lock:
            self._closed = True

    def _again(self) -> None:
        try:
            self._try(again=True)
        finally:
            with self._lock:
                self._in_flight = None

    def _try(self, again: bool) -> bool:
        ports = self.endpoints.ports() if self.endpoints is not None else None
        try:
            endpoints = self._register(ports)
        except Exception as exc:  # noqa: BLE001 - a background try's failure is never the engine's to handle
            if not again and not isinstance(exc, TierCacheError):
                raise  # at the engine's start, a bug fails it (a refused or unreachable server is a warning)
            with self._lock:
                first = self._failures is None
                if first:
                    self._failures = self._backoff.delays()
                delay = next(self._failures)
                self._not_before = time.monotonic() + delay
            # One warning per outage; the tries that follow (one per backoff delay) at debug.
            (log.warning if first else log.debug)(
                "TierCacheConnector: the server publishes no KV events for pod %s: %s (next try in %g s at the "
                "earliest)", self.pod_id, exc, delay)
            return False
        with self._lock:
            if self._closed and again:
                return False
            self._failures = None
            self._not_before = float("-inf")
            self._answered_at = time.monotonic()
            self.endpoints = endpoints
            self.registered_again += again
        if again:
            log.info("TierCacheConnector: the server did not know pod %s (it restarted?): registered it again; KV "
                     "events on %s (replay %s, topic %s)", self.pod_id, endpoints.endpoint, endpoints.replay_endpoint,
                     endpoints.topic)
        else:
            log.info("TierCacheConnector: KV events of pod %s on %s (replay %s, topic %s)", self.pod_id,
                     endpoints.endpoint, endpoints.replay_endpoint, endpoints.topic)
        return True
