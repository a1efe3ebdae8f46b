"""The one place where the SGLang backend turns errors into answers.

SGLang calls the backend from its prefetch and backup threads, and an exception there kills the thread (and with it
the engine's storage tier), so no exception reaches SGLang: every call of its interface is `answered` — an error
is answered with the call's failure value (misses, False) and logged, but never once per call:
- the server unreachable (Unavailable): one warning per outage, and one line when it answers again; while the
  client's circuit breaker is open (CircuitOpen) the calls fail at once, silently;
- a refusal (any other TierCacheError: a salt the token does not own, a quota, a page that does not fit) and a pool
  that does not fit (PoolMismatch): once per kind;
- anything else is a bug: logged with its traceback, once per method.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

from tiercache.connector.sglang.pools import PoolMismatch
from tiercache.errors import CircuitOpen, TierCacheError, Unavailable

log = logging.getLogger("tiercache.connector.sglang")


class Guard:
    def __init__(self, name: str) -> None:
        self.name = name  # how log lines name the backend
        self._logged: set[str] = set()  # kinds already logged
        self._outage = False  # the server did not answer, and has not answered since
        self._lock = threading.Lock()

    def answered(self, method: Callable, failed: Callable[..., Any], instance, args, kwargs):
        """`method(instance, *args, **kwargs)`, or `failed(instance, *args, **kwargs)` when it raises."""
        try:
            result = method(instance, *args, **kwargs)
        except CircuitOpen:
            return failed(instance, *args, **kwargs)
        except Unavailable as exc:
            if self._first("outage"):
                log.warning("%s: the cache server did not answer (%s); pages are misses and writes are dropped until "
                            "it does", self.name, exc)
            return failed(instance, *args, **kwargs)
        except PoolMismatch as exc:
            self.warn_once(exc.kind, str(exc))
            return failed(instance, *args, **kwargs)
        except TierCacheError as exc:
            if self._first(type(exc).__name__):
                log.warning("%s: %s: %s (such calls are misses or dropped writes; logged once)", self.name,
                            type(exc).__name__, exc)
            return failed(instance, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take SGLang's storage thread down
            if self._first(f"bug:{method.__name__}"):
                log.exception("%s.%s failed (answered as a miss; logged once): %r", self.name, method.__name__, exc)
            return failed(instance, *args, **kwargs)
        self._answered_again()
        return result

    def warn_once(self, kind: str, message: str) -> None:
        if self._first(kind):
            log.warning("%s: %s (logged once)", self.name, message)

    def _first(self, kind: str) -> bool:
        with self._lock:
            if kind == "outage":
                first, self._outage = not self._outage, True
                return first
            if kind in self._logged:
                return False
            self._logged.add(kind)
            return True

    def _answered_again(self) -> None:
        if self._outage:
            with self._lock:
                if not self._outage:
                    return
                self._outage = False
            log.info("%s: the cache server answers again", self.name)


def answers(failed: Callable[..., Any]):
    """Decorates a method of an object with a `guard` (Guard): its errors become `failed(self, *args)`."""
    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            return self.guard.answered(method, failed, self, args, kwargs)
        return guarded
    return decorate
