"""The same-host path, a payload path (client.payload): chunk bytes copied in place into and out of the server's
shared-memory arena (client.shared_arena), gRPC carrying only control.

A put reserves ranges (Reserve), copies each payload into its ranges and commits them (Commit); a get pins chunks
in the arena (Acquire), copies them out and releases the pins (Release). Every grant is a lease the server takes back
after its TTL, so a client that dies holds nothing; the flip side is that a copy that outlived its lease may have read
reused pages, which Release reports: such a chunk is answered ELSEWHERE and fetched by another path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

from tiercache.client.payload import ELSEWHERE, Chunk, Elsewhere, Fetched
from tiercache.client.shared_arena import SharedArena
from tiercache.client.transport import call
from tiercache.errors import TierCacheError
from tiercache.protocol.wire import chunk_header, pb, pb_grpc

log = logging.getLogger(__name__)


class ArenaPath:
    """`release_timeout_s`: the deadline of a Release sent in the background."""

    def __init__(self, stub: pb_grpc.TierCacheStub, arena: SharedArena, lease_ttl_s: float,
                 release_timeout_s: float) -> None:
        self._stub = stub
        self.arena = arena
        self._lease_ttl_s = lease_ttl_s
        self._releases = BackgroundReleases(self._release_in_background, release_timeout_s)

    def put(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]:
        """A full arena or a reservation that lapsed before its commit raises CapacityExceeded or NotFound: the
        chooser then puts the chunks by a remote path, which places them in any tier."""
        return [tier for batch in _batches(chunks, self.arena.batch_bytes)
                for tier in self._put_batch(namespace, batch, deadline)]

    def _put_batch(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]:
        headers = [chunk_header(namespace, key, len(payload), meta) for key, payload, meta in chunks]
        reservations = call(self._stub.Reserve, pb.ReserveRequest(namespace=namespace, chunks=headers),
                            deadline).reservations
        ids = pb.LeaseIds(lease_ids=[r.lease_id for r in reservations])
        try:
            for (_, payload, _), reservation in zip(chunks, reservations):
                self.arena.write([(r.offset, r.length) for r in reservation.payload], payload)
        except BaseException:
            try:
                call(self._stub.Abort, ids, deadline)
            except TierCacheError as exc:  # the reservations lapse on their own after the server's TTL
                log.debug("aborting %d reservations failed: %s", len(ids.lease_ids), exc)
            raise
        return list(call(self._stub.Commit, ids, deadline).stored_in)

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            deadline: float) -> list[Fetched | Elsewhere | None]:
        asked = time.monotonic()  # every lease below started after this
        leases = call(self._stub.Acquire, pb.KeysRequest(namespace=namespace, keys=keys), deadline).leases
        ids = [lease.lease_id for lease in leases if lease.leased]
        try:
            results = [self._copied(lease, out) for lease, out in zip(leases, outs)]
        except BaseException:
            self._releases.add(ids)
            raise
        lapsed = self._release(ids, asked, deadline)
        return [ELSEWHERE if lease.leased and lease.lease_id in lapsed else result
                for lease, result in zip(leases, results)]

    def _copied(self, lease: pb.Lease, out: memoryview | None) -> Fetched | Elsewhere | None:
        if not lease.found:
            return None
        if not lease.leased:  # found, but not pinnable in the arena (no room): the server sends it another way
            return ELSEWHERE
        ranges = [(r.offset, r.length) for r in lease.payload]
        return Fetched(self.arena.read(ranges, lease.size_bytes, out), lease.tier)

    def _release(self, ids: list[int], asked: float, deadline: float) -> set[int]:
        """Release read leases; the ones that had lapsed before (what was copied under them is suspect)."""
        if not ids:
            return set()
        if time.monotonic() - asked < self._lease_ttl_s / 2:
            # Copied well inside the leases (the server's clock is this host's monotonic clock, and each lease
            # began after `asked`): the bytes are valid whatever Release says, so it need not be waited for.
            self._releases.add(ids)
            return set()
        return set(call(self._stub.Release, pb.LeaseIds(lease_ids=ids), deadline).expired)

    def _release_in_background(self, ids: list[int], deadline: float) -> None:
        call(self._stub.Release, pb.LeaseIds(lease_ids=ids), deadline)

    @property
    def released_in_background(self) -> int:
        """Read leases handed to the background thread so far."""
        return self._releases.handed

    def close(self) -> None:
        self._releases.close()  # sends what is pending while the channel is still open
        self.arena.close()


class BackgroundReleases:
    """Read leases released off the caller's path, in batches, by one daemon thread (started on first use). A failed
    Release is harmless: the leases lapse on their own after the server's TTL. `close()` sends what is pending."""

    def __init__(self, release: Callable[[list[int], float], None], timeout_s: float) -> None:
        self._release = release
        self._timeout_s = timeout_s
        self._pending: list[int] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.handed = 0

    def add(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        with self._changed:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="tiercache-release", daemon=True)
                self._thread.start()
            self._pending.extend(ids)
            self.handed += len(ids)
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if not self._pending:
                    return
                ids, self._pending = self._pending, []
            try:
                self._release(ids, time.monotonic() + self._timeout_s)
            except TierCacheError as exc:
                log.debug("releasing %d read leases failed (they lapse on their own): %s", len(ids), exc)


def _batches(chunks: Sequence[Chunk], limit: int) -> Iterator[list[Chunk]]:
    """Split a put into batches of at most `limit` payload bytes (always at least one chunk per batch)."""
    batch: list[Chunk] = []
    size = 0
    for chunk in chunks:
        if batch and size + len(chunk.data) > limit:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += len(chunk.data)
    if batch:
        yield batch
