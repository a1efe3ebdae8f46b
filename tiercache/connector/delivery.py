"""A connector's reports of what its engine did with tiercache's bytes (tiercache.prefix.delivered): tokens loaded
beyond the engine's own hit, loads that failed, saves dropped. Counted where the connector learns them (the engine's
thread), sent by a thread of this module's own at most every `interval_s`, so an engine never waits on a report. A
report that fails stays and goes with the next one: the dropped saves of an outage reach the server once it answers
again (tests/connector/test_delivery.py).
"""

from __future__ import annotations

import logging
import threading

from tiercache.client import Client
from tiercache.errors import TierCacheError
from tiercache.prefix.delivered import Delivered

log = logging.getLogger(__name__)


class DeliveryReporter:
    def __init__(self, client: Client, namespace: str, interval_s: float = 1.0) -> None:
        self.client = client
        self.namespace = namespace
        self.interval_s = interval_s
        self.sent = Delivered()  # what the server acknowledged (tests, logs)
        self._pending = Delivered()
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tiercache-delivery", daemon=True)
        self._thread.start()

    def add(self, delivered: Delivered) -> None:
        if delivered.is_empty():
            return
        with self._changed:
            self._pending = self._pending + delivered
            self._changed.notify()

    def flush(self) -> bool:
        """Send what is pending now, on this thread; False when the server did not take it (it stays pending)."""
        with self._changed:
            report, self._pending = self._pending, Delivered()
        if report.is_empty():
            return True
        try:
            self.client.report_delivery(self.namespace, report)
        except TierCacheError as exc:
            log.debug("tiercache: delivery report not sent (kept for the next): %s", exc)
            with self._changed:
                self._pending = report + self._pending
            return False
        with self._changed:
            self.sent = self.sent + report
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread after one last report, waiting for it at most `timeout_s`: an engine's exit must not wait
        on a hung server (the thread is a daemon; what it could not send is lost with the process)."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._pending.is_empty() and not self._stopped:
                    self._changed.wait()
                stopped = self._stopped
            self.flush()
            if stopped:
                return
            with self._changed:
                self._changed.wait_for(lambda: self._stopped, self.interval_s)
