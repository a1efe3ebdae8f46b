"""Leases of the same-host path: every reservation and every read pin the server grants expires.

A client that crashes cannot hold memory forever: an expired read pin is released, an expired reservation is aborted.
A chunk under a read lease is never overwritten (the arena does not reuse pinned pages). Because a client cannot be
unmapped, the protocol also covers clients that are merely slow: Release reports leases that had already expired, and
the client then discards what it copied (the pages may have been reused) and reads the chunk again over gRPC; an
expired reservation is quarantined for one more TTL before its pages are reused, so a writer that stalls past its
lease writes into pages nobody else holds yet (its Commit then fails and it puts the chunk again over gRPC).
What a lease holds is a grant of the store's same-host path (tiercache.store.same_host)."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tiercache.errors import NotFound


@dataclass
class _Lease:
    handle: object
    release: Callable[[object], None]  # abort a reservation / unpin a read
    expires_at: float
    writable: bool
    quarantined: bool = False  # an expired reservation whose pages are held one more TTL


class LeaseTable:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="tiercache-leases", daemon=True)
        self._reaper.start()

    def grant(self, handle: object, release: Callable[[object], None], writable: bool) -> int:
        lease_id = secrets.randbits(63) or 1  # unguessable: one client cannot commit or release another's lease
        with self._lock:
            self._leases[lease_id] = _Lease(handle, release, time.monotonic() + self.ttl_s, writable)
        return lease_id

    def take(self, lease_id: int, writable: bool) -> object:
        """Remove a lease and hand back what it holds; the caller now owns releasing it."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.writable != writable or lease.quarantined:
                raise NotFound(f"no {'reservation' if writable else 'read lease'} {lease_id} (expired?)")
            del self._leases[lease_id]
        return lease.handle

    def release(self, lease_ids: Sequence[int], writable: bool) -> list[int]:
        """Release leases; returns the ids that were no longer held (expired): data read under them is suspect."""
        gone = []
        for lease_id in lease_ids:
            with self._lock:
                lease = self._leases.get(lease_id)
                if lease is None or lease.writable != writable or lease.quarantined:
                    gone.append(lease_id)
                    continue
                del self._leases[lease_id]
            lease.release(lease.handle)
        return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def all_quarantined(self) -> bool:
        """Leases are held and every one is a lapsed reservation held one more TTL (operators, tests)."""
        with self._lock:
            return bool(self._leases) and all(lease.quarantined for lease in self._leases.values())

    def expire(self, now: float | None = None, quarantine: bool = True) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = []
            for lease_id, lease in list(self._leases.items()):
                if lease.expires_at > now:
                    continue
                if lease.writable and quarantine and not lease.quarantined:
                    lease.quarantined, lease.expires_at = True, now + self.ttl_s
                    continue
                del self._leases[lease_id]
                expired.append(lease)
        for lease in expired:  # outside the lock: releasing takes the tier's lock
            lease.release(lease.handle)
        return len(expired)

    def close(self) -> None:
        self._closed.set()
        self.expire(now=float("inf"), quarantine=False)

    def _reap(self) -> None:
        while not self._closed.wait(min(1.0, self.ttl_s / 4)):
            self.expire()
