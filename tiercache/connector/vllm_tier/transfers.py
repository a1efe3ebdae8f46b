"""The tier's store and load jobs, run on threads of their own between vLLM's CPU pool and the server.

A job names slots of vLLM's shared CPU pool (rows of the memoryview the tier was given); a store puts each slot's
bytes under its key, a load gets each key's bytes straight into its slot (the client fills the buffer it is given:
no copy beyond the one its path makes). vLLM pins a job's slots until the job is reported, so a job is reported
only once its thread has returned from the client, and nothing of it can still read or write a slot (the client
returns, or raises, only once every stripe of a call has finished: client.data_channel's `_in_parallel`). Loads go
before stores (a load holds a request back; a store is for later). Every failure is the job's: counted, reported as
failed, never raised into vLLM's scheduler.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tiercache.client import Chunk, Client

log = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20  # one put_many / get_many round


@dataclass(frozen=True)
class Job:
    job_id: int
    keys: Sequence[bytes]
    slots: Sequence[int]
    load: bool


@dataclass(frozen=True)
class Finished:
    job_id: int
    load: bool
    ok: list[bytes]  # the keys stored or loaded
    failed: list[bytes]
    seconds: float
    nbytes: int  # bytes moved (the keys that succeeded)


@dataclass
class TransferCounts:
    stored_chunks: int = 0
    stored_bytes: int = 0
    skipped_chunks: int = 0  # stores of keys the server was last seen holding
    store_failures: int = 0  # chunks
    shed_chunks: int = 0  # stores refused because too many bytes were queued
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0  # chunks: a miss after a hit, a size mismatch, a failed call


@dataclass
class _Queues:
    loads: collections.deque = field(default_factory=collections.deque)
    stores: collections.deque = field(default_factory=collections.deque)
    store_bytes: int = 0
    running: int = 0


class Transfers:
    """`namespace()` names the server namespace (resolved on first use); `slot(i)` is slot i's writable bytes;
    `known_present(keys)` says which keys a store may skip."""

    def __init__(self, client: Client, namespace: Callable[[], str], slot: Callable[[int], memoryview],
                 slot_bytes: int, threads: int, max_pending_store_bytes: int,
                 known_present: Callable[[Sequence[bytes]], list[bool]]) -> None:
        self._client = client
        self._namespace = namespace
        self._slot = slot
        self._slot_bytes = slot_bytes
        self._max_pending = max_pending_store_bytes
        self._known_present = known_present
        self._queues = _Queues()
        self._finished: list[Finished] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self.counts = TransferCounts()
        self._threads = [threading.Thread(target=self._work, name=f"tiercache-tier-io-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if job.load:
                self._queues.loads.append(job)
            elif self._queues.store_bytes + len(job.keys) * self._slot_bytes > self._max_pending:
                self.counts.shed_chunks += len(job.keys)
                self._finished.append(Finished(job.job_id, False, [], list(job.keys), 0.0, 0))
                return
            else:
                self._queues.stores.append(job)
                self._queues.store_bytes += len(job.keys) * self._slot_bytes
            self._changed.notify_all()

    def finished(self) -> list[Finished]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queues.loads or self._queues.stores or self._queues.running)

    def drain(self) -> None:
        """Wait until every submitted job has finished (each job's calls end by the client's deadline)."""
        with self._lock:
            while self._queues.loads or self._queues.stores or self._queues.running:
                self._changed.wait()

    def close(self) -> None:
        self.drain()
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not (self._queues.loads or self._queues.stores or self._closed):
                    self._changed.wait()
                if self._closed:
                    return
                job = (self._queues.loads or self._queues.stores).popleft()
                if not job.load:
                    self._queues.store_bytes -= len(job.keys) * self._slot_bytes
                self._queues.running += 1
            started = time.perf_counter()
            ok, failed = self._run(job)
            done = Finished(job.job_id, job.load, ok, failed, time.perf_counter() - started,
                            len(ok) * self._slot_bytes)
            with self._lock:
                self._count(done)
                self._finished.append(done)
                self._queues.running -= 1
                self._changed.notify_all()

    def _run(self, job: Job) -> tuple[list[bytes], list[bytes]]:
        ok: list[bytes] = []
        failed: list[bytes] = []
        per_batch = max(1, _BATCH_BYTES // max(self._slot_bytes, 1))
        for start in range(0, len(job.keys), per_batch):
            keys = list(job.keys[start:start + per_batch])
            slots = list(job.slots[start:start + per_batch])
            try:
                done = self._load(keys, slots) if job.load else self._store(keys, slots)
            except Exception as exc:  # noqa: BLE001 - a failed call fails its keys, whatever it was
                log.debug("tiercache tier: a %s of %d chunks failed: %s", "load" if job.load else "store",
                          len(keys), exc)
                done = [False] * len(keys)
            for key, success in zip(keys, done):
                (ok if success else failed).append(key)
        return ok, failed

    def _store(self, keys: list[bytes], slots: list[int]) -> list[bool]:
        skip = self._known_present(keys)
        chunks = [Chunk(key, self._slot(slot)) for key, slot, known in zip(keys, slots, skip) if not known]
        if chunks:
            self._client.put_many(self._namespace(), chunks)
        with self._lock:
            self.counts.skipped_chunks += sum(skip)
        return [True] * len(keys)

    def _load(self, keys: list[bytes], slots: list[int]) -> list[bool]:
        fetched = self._client.get_many(self._namespace(), keys, into=[self._slot(slot) for slot in slots])
        return [got is not None and len(got.data) == self._slot_bytes for got in fetched]

    def _count(self, done: Finished) -> None:
        counts = self.counts
        if done.load:
            counts.loaded_chunks += len(done.ok)
            counts.loaded_bytes += done.nbytes
            counts.load_failures += len(done.failed)
        else:
            counts.stored_chunks += len(done.ok)
            counts.stored_bytes += done.nbytes
            counts.store_failures += len(done.failed)
