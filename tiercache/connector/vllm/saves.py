"""The vLLM worker's saves: objects copied out of vLLM's blocks into host staging buffers, and put to tiercache.

Saves are gathered once the step's forward pass is over (`wait_for_save`: the blocks hold what the plan names until
the next step writes them) and put on a background thread (put_queue), so the engine never waits for the network.
On CPU the gather itself runs on a thread beside the engine, between its steps, and `before_step` (vLLM's
`handle_preemptions`, the first thing a step does, before it copies states or frees and reuses blocks) waits for it:
the engine's thread no longer pays for the copies. On CUDA the gather runs on a stream of their own into pinned
buffers. Saves beyond the staging bytes are dropped with a warning: a cache may forget, an engine must not stall.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable

import torch

from tiercache.client import Client
from tiercache.connector.prefix_cache import SaveResult, WithEngineBlock
from tiercache.connector.vllm.layout import PoolSets, pool_key
from tiercache.connector.vllm.plan import Job, Transfer
from tiercache.connector.vllm.put_queue import Put, PutQueue
from tiercache.connector.vllm.salts import PerSalt
from tiercache.connector.vllm.staging import COPIED, ObjectRows, StagingPool, staging_lane
from tiercache.connector.vllm.worker_stats import WorkerStats
from tiercache.prefix.delivered import DROPPED_BACKLOG, DROPPED_ERROR, Delivered

log = logging.getLogger(__name__)


class Saves:
    def __init__(self, client: Client, namespaces: PerSalt[str], staging_bytes: int, stats: WorkerStats, *,
                 engine_blocks: bool, batch_s: float = 0.05,
                 on_dropped: Callable[[Delivered], None] = lambda dropped: None) -> None:
        """`namespaces`: this rank's namespace per salt; `staging_bytes`: host memory for saves not yet put (past
        it they are dropped); `engine_blocks`: kv saves carry vLLM's view of their block (one rank's copy serves
        every rank); `batch_s`: how long puts gather before they are sent (put_queue); `on_dropped`: told of every
        object that will not reach a server (the connector reports them)."""
        self.client = client
        self.stats = stats
        self.pools: PoolSets | None = None
        self._namespaces = namespaces
        self._staging_bytes = staging_bytes
        self._engine_blocks = engine_blocks
        self._batch_s = batch_s
        self._on_dropped = on_dropped
        self.staging: StagingPool | None = None
        self._puts: PutQueue | None = None
        self._gatherer: ThreadPoolExecutor | None = None  # CPU step saves' copies, between the engine's steps
        self._stream = None  # CUDA: the stream the copies go on
        self._gathers: list[Future] = []  # gathers the next step must wait for (vLLM's thread only)
        self._steps_fenced = False  # the engine calls before_step each step: gathers may run beside it
        self._lock = threading.Lock()
        self._saved_finished: set[str] = set()
        self._gathering: list[tuple[set[str], object]] = []  # end-of-request saves whose copies are in flight (CUDA)

    def register(self, pools: PoolSets, on_thread_start: Callable[[], None]) -> None:
        """The engine's caches are known: make the staging pool, the gathering and putting threads (started by
        `on_thread_start`: off vLLM's compute cores) and, on CUDA, the copies' stream."""
        self.pools = pools
        self.staging, self._gatherer, self._stream = staging_lane(pools.device, self._staging_bytes, "tiercache-gather",
                                                                  on_thread_start)
        self._puts = PutQueue(self.client, self.staging, self._put_done, batch_s=self._batch_s,
                              on_start=on_thread_start)

    @property
    def registered(self) -> bool:
        return self.pools is not None

    def before_step(self) -> None:
        """The start of an engine step, before it writes any block: the gathers of the last step's saves must be
        done (vLLM calls this first thing in every step; until it has, gathers run on vLLM's thread). Every gather,
        not only those of requests that ended: vLLM also frees blocks of running requests (align-mode Mamba blocks
        behind the last state, sliding-window pages), and the step may hand them to another request."""
        self._steps_fenced = True
        if self._gathers:
            futures_wait(self._gathers)
            self._gathers = []

    def save(self, jobs: list[Job], inline: bool = False) -> None:
        """Gather every object this step's jobs name into one staging buffer (the blocks hold them until the next
        step writes), and put them on the background thread: one put per namespace, the engine never waits for it
        (`inline`: on this thread, at shutdown).

        On CUDA the gather runs on a side stream after this step's forward pass, vLLM's thread does not wait for it
        and the put waits for its event; vLLM's stream waits for it (on the device) only when an object lives in a
        block the next step writes (a request's running recurrent state). On CPU the gather runs on the gathering
        thread while vLLM finishes this step and schedules the next (before_step waits for it); the saves at a
        request's end are gathered here, so that vLLM frees their blocks at the end of this step, as it expects."""
        if self._stream is None and self._steps_fenced and not inline:
            self._save_jobs([job for job in jobs if job.finish])
            self._save_jobs([job for job in jobs if not job.finish], beside=True)
        else:
            self._save_jobs(jobs, inline=inline)

    def finished(self) -> set[str]:
        """Requests whose end-of-request saves have been copied out since the last call: vLLM may free their
        blocks (its finished_sending)."""
        with self._lock:
            still = []
            for req_ids, gathered in self._gathering:
                if gathered.query():
                    self._saved_finished |= req_ids
                else:
                    still.append((req_ids, gathered))
            self._gathering = still
            saved, self._saved_finished = self._saved_finished, set()
        return saved

    def drain(self, deadline: float | None) -> bool:
        """Wait for every gather and put (shutdown, tests); False when `deadline` (time.monotonic()) passed first."""
        # (Waits on the futures already there: at interpreter exit the executors take no new work. A gather hands
        # its put to the put queue before it ends, so every put is queued once the gathers are done.)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if futures_wait(self._gathers, timeout=left).not_done:
            return False
        self._gathers = []
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._puts.flush(left)

    def stop(self) -> None:
        self._puts.stop()
        self._gatherer.shutdown(wait=False, cancel_futures=True)

    # -- gathering ---------------------------------------------------------------------------------------------------

    def _save_jobs(self, jobs: list[Job], inline: bool = False, beside: bool = False) -> None:
        """One staging buffer and one put per namespace for `jobs`; `beside`: gathered on the gathering thread."""
        transfers = sorted(((job, t) for job in jobs for t in job.transfers), key=lambda item: pool_key(item[1]))
        finished = {job.req_id for job in jobs if job.finish}
        if not transfers:
            self._finished_saving(finished, COPIED)
            return
        sizes = [self.pools.object_bytes(t) for _, t in transfers]
        staged = self.staging.take(sum(sizes))
        if staged is None:
            self._dropped({DROPPED_BACKLOG: len(transfers)})
            log.warning("tiercache: %d bytes of saves pending, dropping %d objects of %d requests",
                        self.staging.out_bytes, len(transfers), len(jobs))
            self._finished_saving(finished, COPIED)  # nothing to copy: vLLM may free the blocks
            return
        rows = ObjectRows(staged, sizes)
        by_namespace: dict[str, dict] = {}
        for (job, transfer), view in zip(transfers, rows.buffers()):
            engine = transfer.engine if self._engine_blocks else None
            by_namespace.setdefault(self._namespaces[job.salt], {})[transfer.ref] = \
                view if engine is None else WithEngineBlock(view, engine)
        objects = [t for _, t in transfers]
        if beside:
            self._gathers.append(self._gatherer.submit(self._gather_and_put, objects, rows, by_namespace))
            return
        try:
            gathered = self._gather_in_inference_mode(objects, rows)
        except BaseException:
            self.staging.give_back(staged)
            raise
        self._finished_saving(finished, gathered)
        put = Put(by_namespace, gathered, staged, rows.total)
        if inline:  # at exit: no other thread may run any more
            self._puts.send_now(put)
        else:
            self._puts.add(put)

    def _gather_in_inference_mode(self, transfers: list[Transfer], rows: ObjectRows):
        # Inference mode as in vLLM's steps (the staging buffers are inference tensors once a step made them); a
        # flush at shutdown and the gathering thread run outside the steps.
        with torch.inference_mode():
            return self._gather(transfers, rows)

    def _gather_and_put(self, transfers: list[Transfer], rows: ObjectRows, by_namespace: dict) -> None:
        """The gathering thread's part of a CPU save: the copies, then the put handed to the saver thread (a slow
        server delays puts, never the next gather, which the engine waits for)."""
        try:
            gathered = self._gather_in_inference_mode(transfers, rows)
        except Exception:  # a save must never take the engine down
            log.exception("tiercache: gathering %d objects to save failed; they are not saved", len(transfers))
            self._dropped({DROPPED_ERROR: len(transfers)})
            self.staging.give_back(rows.buffer)
            return
        self._puts.add(Put(by_namespace, gathered, rows.buffer, rows.total))

    def _gather(self, transfers: list[Transfer], rows: ObjectRows):
        """Copy the objects' bytes into their rows; what marks the end of the copies (a CUDA event, or COPIED)."""
        if self._stream is None:
            self.pools.gather(transfers, rows)
            return COPIED
        current = torch.cuda.current_stream(self.pools.device)
        self._stream.wait_stream(current)  # after this step's forward pass wrote the blocks
        with torch.cuda.stream(self._stream):
            self.pools.gather(transfers, rows)
            done = torch.cuda.Event()
            done.record(self._stream)
        if any(t.running for t in transfers):
            current.wait_event(done)  # the next step rewrites a running state: not before it is copied
        return done

    # -- what became of them -----------------------------------------------------------------------------------------

    def _finished_saving(self, req_ids: set[str], gathered) -> None:
        """End-of-request saves: vLLM may free the blocks once their bytes are copied out."""
        if not req_ids:
            return
        with self._lock:
            if gathered is COPIED:
                self._saved_finished |= req_ids
            else:
                self._gathering.append((req_ids, gathered))

    def _put_done(self, result: SaveResult) -> None:
        with self._lock:
            self.stats.objects_saved += result.objects
            self.stats.bytes_saved += sum(result.bytes_by_tier.values())
        if result.dropped:
            self._dropped(result.dropped)

    def _dropped(self, by_reason: dict[str, int]) -> None:
        with self._lock:
            for reason, n in by_reason.items():
                self.stats.saves_dropped += n
                name = f"saves_dropped_{reason}"
                setattr(self.stats, name, getattr(self.stats, name) + n)
        self._on_dropped(Delivered(saves_dropped_by_reason=dict(by_reason)))
