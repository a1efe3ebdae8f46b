"""The vLLM worker's loads: objects fetched from tiercache and copied into the blocks vLLM allocated for a request.

A load is fetched on a background thread (sizes checked there); the copies into the request's blocks run on vLLM's
own thread at the next step boundary, and the load is reported when they are done. Any missing, corrupt (the server
never returns a chunk that fails its checksum) or mis-sized object fails the whole load, and vLLM recomputes the
request: a partial load is never reported as a hit. On CUDA the copies go on a stream of their own from pinned
staging buffers; on CPU they are the copy kernels' torch reference.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from tiercache.client import Client
from tiercache.connector.vllm.layout import PoolSets
from tiercache.connector.vllm.plan import Job
from tiercache.connector.vllm.salts import PerSalt
from tiercache.connector.vllm.staging import COPIED, ObjectRows, StagingPool, staging_lane
from tiercache.connector.vllm.worker_stats import WorkerStats
from tiercache.errors import CircuitOpen, TierCacheError

log = logging.getLogger(__name__)

# How long a step in which vLLM computes nothing waits for loads still being fetched (a same-host fetch takes about a
# millisecond; a slow or remote one is reported at a later step instead of stalling the engine).
IDLE_FETCH_WAIT_S = 0.05


class LoadsEnded(NamedTuple):
    """Requests whose load ended since the last ask: all of them (vLLM's finished_recving), and those that failed."""

    ended: set[str]
    failed: set[str]


class Loads:
    def __init__(self, client: Client, namespaces: PerSalt[str], staging_bytes: int, stats: WorkerStats) -> None:
        """`namespaces`: this rank's namespace per salt; `staging_bytes`: host memory kept for loads in flight."""
        self.client = client
        self.stats = stats
        self.pools: PoolSets | None = None
        self._namespaces = namespaces
        self._staging_bytes = staging_bytes
        self._staging: StagingPool | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        self._stream = None  # CUDA: the stream the copies go on
        self._pending: list[_PendingLoad] = []  # started, not reported yet (vLLM's thread only)
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()

    def register(self, pools: PoolSets, on_thread_start: Callable[[], None]) -> None:
        """The engine's caches are known: make the staging pool, the fetching thread (started by
        `on_thread_start`: off vLLM's compute cores) and, on CUDA, the copies' stream."""
        self.pools = pools
        self._staging, self._fetcher, self._stream = staging_lane(pools.device, self._staging_bytes, "tiercache-load",
                                                                  on_thread_start)

    def start(self, jobs: list[Job]) -> None:
        """Start fetching this step's loads (vLLM's start_load_kv)."""
        ready = None
        if self._stream is not None and jobs:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.pools.device))  # after this step's block zeroing
        for job in jobs:
            self._pending.append(_PendingLoad(job, ready, self._fetcher.submit(self._fetch, job)))

    def ended(self, idle: bool = False) -> LoadsEnded:
        """Copy what has been fetched into its blocks and say which loads ended since the last call. `idle`: vLLM
        computed nothing this step, so loads still being fetched are waited for (briefly) and reported now, not a
        step later."""
        self._copy_fetched(wait_s=IDLE_FETCH_WAIT_S if idle else 0.0)
        with self._lock:
            loaded, failed = self._loaded, self._failed
            self._loaded, self._failed = set(), set()
        return LoadsEnded(loaded | failed, failed)

    def drain(self, deadline: float | None) -> bool:
        """Wait for every started load to be fetched and copied (shutdown, tests); False when `deadline`
        (time.monotonic()) passed first."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if futures_wait([p.fetch for p in self._pending], timeout=left).not_done:
            return False
        self._copy_fetched(wait=True)
        return True

    def stop(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)

    # -- fetching (the fetching thread) ------------------------------------------------------------------------------

    def _fetch(self, job: Job) -> "_Fetched | None":
        """The job's objects' bytes, fetched into a staging buffer, an object per row of each pool set's part
        (network and shared memory, little Python), or None when the load failed."""
        sizes = [self.pools.object_bytes(t) for t in job.transfers]
        staged = self._staging.take(sum(sizes))
        kept = staged is not None
        if staged is None:  # more than the staging bytes of loads at once: this one's buffer is not kept
            staged = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self._staging.pinned)
        rows = ObjectRows(staged, sizes)
        try:
            fetched = self.client.get_many(self._namespaces[job.salt], [t.ref.key for t in job.transfers],
                                           rows.buffers())
        except TierCacheError as exc:
            (log.debug if isinstance(exc, CircuitOpen) else log.warning)(
                "tiercache load for request %s failed, recomputing: %s", job.req_id, exc)
            fetched = None
        except BaseException:
            self._give_back(staged, kept)
            raise
        if fetched is not None:
            for transfer, item, size in zip(job.transfers, fetched, sizes):
                if item is None or len(item.data) != size:
                    log.warning("tiercache load for request %s: object at %d (%s) is %s; recomputing", job.req_id,
                                transfer.ref.position, transfer.ref.kind.name,
                                "gone" if item is None else f"{len(item.data)} bytes, not {size}")
                    fetched = None
                    break
        if fetched is None:
            self._give_back(staged, kept)
            return None
        return _Fetched(rows, kept)

    def _give_back(self, staged: torch.Tensor, kept: bool) -> None:
        if kept:
            self._staging.give_back(staged)

    # -- copying (vLLM's thread) -------------------------------------------------------------------------------------

    def _copy_fetched(self, wait_s: float = 0.0, wait: bool = False) -> None:
        """Copy every fetched load into its blocks, on vLLM's thread (called each step). `wait_s`: wait up to this
        long for fetches still running (a step in which vLLM computes nothing: the engine has nothing better to do,
        and a fetch thread that needs the GIL gets it while this thread sleeps); `wait`: for every started load to
        be fetched and copied.

        The copies run here and not on the fetching thread: vLLM's busy scheduling loop holds the GIL between
        steps, and each torch call a background thread makes waits for it again (a 4,096-token load spent ~130 ms
        copying on a thread, a few ms here: benchmarks/vllm_engine.py). On CUDA the copies go on the load stream and
        the load is reported once its event has completed."""
        if wait_s > 0 and self._pending:
            futures_wait([p.fetch for p in self._pending if p.copied is None], timeout=wait_s)
        still = []
        for pending in self._pending:
            if pending.copied is None:
                if not (wait or pending.fetch.done()):
                    still.append(pending)
                    continue
                if not self._start_copy(pending):
                    self._end(pending.job.req_id, False, 0)
                    continue
            if wait:
                pending.copied.synchronize()
            if pending.copied.query():
                self._give_back(pending.staged.rows.buffer, pending.staged.kept)
                self._end(pending.job.req_id, True, pending.size)
            else:
                still.append(pending)
        self._pending = still

    def _start_copy(self, pending: "_PendingLoad") -> bool:
        """Start copying a fetched load into its blocks; False when the load failed (fetch or copy)."""
        try:
            fetched = pending.fetch.result()
            if fetched is None:
                return False
            pending.staged = fetched
            pending.copied = self._into_blocks(pending.job, fetched.rows, pending.ready)
            pending.size = fetched.rows.total
            return True
        except Exception:  # a load must end reported, whatever went wrong; vLLM then recomputes
            log.exception("tiercache load for request %s failed", pending.job.req_id)
            if pending.staged is not None:
                self._give_back(pending.staged.rows.buffer, pending.staged.kept)
            return False

    def _into_blocks(self, job: Job, rows: ObjectRows, ready):
        """Copy a job's objects into their blocks; what marks the end of the copies (a CUDA event, or COPIED)."""
        if self._stream is None:
            self.pools.scatter(job.transfers, rows)
            return COPIED
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            self.pools.scatter(job.transfers, rows)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def _end(self, req_id: str, ok: bool, size: int) -> None:
        with self._lock:
            (self._loaded if ok else self._failed).add(req_id)
            if ok:
                self.stats.loads_done += 1
                self.stats.bytes_loaded += size
            else:
                self.stats.loads_failed += 1


@dataclass
class _Fetched:
    rows: ObjectRows
    kept: bool  # the staging buffer goes back to the pool (else it was made for this load only)


@dataclass
class _PendingLoad:
    job: Job
    ready: object  # CUDA event: this step's block zeroing is done (None on CPU)
    fetch: object  # Future of the fetched rows (its result is None when the load failed)
    copied: object = None  # once copying started: the CUDA event of the copies, or COPIED
    staged: _Fetched | None = None
    size: int = 0
