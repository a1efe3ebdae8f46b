"""The saves' way to the server: puts handed over step by step, sent in batches by one thread.

Each engine step hands over the objects it gathered (one staging buffer). Sent one step at a time, a put costs
the same fixed work whatever its size — a Reserve and a Commit (same host) or a stream (remote), and the server's
handling of each — and on a host whose CPUs the engine's scheduler also needs, that fixed work, a dozen times a
second, is what a cache costs an engine that reuses nothing (docs/benchmarks.md, lab.serve_trace). So the thread
lets puts gather for up to `batch_s` (or until `batch_bytes` wait), then sends everything waiting as one put per
namespace. A save is then visible to lookups up to `batch_s` later: a cache may lag, never the engine.
`flush` sends at once (shutdown, tests).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tiercache.client import Client
from tiercache.connector.prefix_cache import SaveResult, save_objects
from tiercache.connector.vllm.staging import StagingPool
from tiercache.prefix.delivered import DROPPED_ERROR, DROPPED_SHUTDOWN

log = logging.getLogger(__name__)


@dataclass
class Put:
    """One step's gathered objects: their bytes as views of one staging buffer, by namespace and object."""

    by_namespace: dict[str, dict]
    gathered: object  # what marks the copies' end: a CUDA event, or an object whose synchronize() returns at once
    staged: torch.Tensor  # the staging buffer, back to the pool once sent
    size: int


class PutQueue:
    def __init__(self, client: Client, staging: StagingPool, on_sent: Callable[[SaveResult], None],
                 batch_s: float = 0.05, batch_bytes: int = 64 << 20,
                 on_start: Callable[[], None] | None = None) -> None:
        self.client = client
        self.staging = staging
        self.batch_s = batch_s
        self.batch_bytes = batch_bytes
        self.batches = 0  # puts sent (each one per namespace)
        self._on_sent = on_sent  # what each batch stored, and what it dropped (by reason)
        self._on_start = on_start  # the thread's first act (moving off the engine's cores)
        self._waiting: list[Put] = []
        self._waiting_bytes = 0
        self._first_at = 0.0  # when the oldest waiting put arrived
        self._sending = 0  # puts taken by the thread, not yet sent
        self._flush = False
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tiercache-save", daemon=True)
        self._thread.start()

    def add(self, put: Put) -> None:
        with self._changed:
            if not self._waiting:
                self._first_at = time.monotonic()
            self._waiting.append(put)
            self._waiting_bytes += put.size
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send what waits now, and wait until it is sent; False when `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            self._flush = True
            self._changed.notify_all()
            while self._waiting or self._sending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            self._flush = False
        return True

    def send_now(self, put: Put) -> None:
        """Send on the caller's thread (at exit, when no other thread may run any more)."""
        with self._changed:
            self._sending += 1
        try:
            self._send([put])
        finally:
            with self._changed:
                self._sending -= 1
                self._changed.notify_all()

    def stop(self) -> None:
        """No more sends (what still waits is dropped: call flush first)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    # -- the thread ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._send(batch)
            finally:
                with self._changed:
                    self._sending -= len(batch)
                    self._changed.notify_all()

    def _next_batch(self) -> list[Put] | None:
        """Every put waiting once the batch is due (`batch_s` after the oldest arrived, `batch_bytes` waiting, or a
        flush); None once stopped."""
        with self._changed:
            while True:
                if self._stopped:
                    self._drop(self._waiting)
                    return None
                if self._waiting:
                    due = self._first_at + self.batch_s - time.monotonic()
                    if self._flush or due <= 0 or self._waiting_bytes >= self.batch_bytes:
                        batch, self._waiting, self._waiting_bytes = self._waiting, [], 0
                        self._sending += len(batch)
                        return batch
                    self._changed.wait(due)
                else:
                    self._changed.wait()

    def _send(self, batch: list[Put]) -> None:
        """One put per namespace for the whole batch (a later step's bytes of an object win), then the staging
        buffers go back."""
        try:
            merged: dict[str, dict] = {}
            for put in batch:
                put.gathered.synchronize()  # CUDA: the side stream's copies (a wait that releases the GIL)
                for namespace, payloads in put.by_namespace.items():
                    merged.setdefault(namespace, {}).update(payloads)
            result = sum((save_objects(self.client, namespace, payloads) for namespace, payloads in merged.items()),
                         SaveResult(0, {}))
        except Exception:  # a save must never take the engine down
            log.exception("tiercache save of %d bytes failed", sum(put.size for put in batch))
            result = SaveResult(0, {}, {DROPPED_ERROR: _objects(batch)})
        finally:
            for put in batch:
                self.staging.give_back(put.staged)
        self.batches += 1
        self._on_sent(result)

    def _drop(self, puts: list[Put]) -> None:
        if puts:
            self._on_sent(SaveResult(0, {}, {DROPPED_SHUTDOWN: _objects(puts)}))
        for put in puts:
            self.staging.give_back(put.staged)
        puts.clear()
        self._waiting_bytes = 0


def _objects(puts: list[Put]) -> int:
    return sum(len(payloads) for put in puts for payloads in put.by_namespace.values())
