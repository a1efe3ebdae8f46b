"""The worker half of the vLLM connector: bytes between vLLM's paged cache and tiercache, with tiercache.kernels.

Objects are whole blocks as vLLM keeps them (see tiercache.connector.vllm.layout): a kv or tail object is one
attention group's page of one block, for all its layers; a state object is every Mamba layer's state bytes of one
block per Mamba group.

Loads fetch on a background thread (and check sizes); the copies into the request's blocks run on vLLM's own thread
at the next step boundary, and the load is reported when they are done. Any missing, corrupt (the server never
returns a chunk that fails its checksum) or mis-sized object fails the whole load, and vLLM recomputes the request:
a partial load is never reported as a hit.

Saves are gathered once the step's forward pass is over (`wait_for_save`: the blocks hold what the plan names until
the next step writes them) into host memory, and put on a background thread, so the engine never waits for the
network. On CPU the gather itself runs on a thread beside the engine, between its steps, and `before_step` (vLLM's
`handle_preemptions`, the first thing a step does, before it copies states or frees and reuses blocks) waits for it:
the engine's thread no longer pays for the copies. Saves beyond `max_pending_save_bytes` are dropped with a warning:
a cache may forget, an engine must not stall.

On CUDA tensors the copies are the CUDA kernels, staged through pinned host memory, loads on their own stream; on
CPU tensors they are the kernels' torch reference.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable

import torch

from tiercache import kernels
from tiercache.client import Client
from tiercache.connector.prefix_cache import SaveResult, WithEngineBlock
from tiercache.connector.vllm.cores import off_compute_cores
from tiercache.connector.vllm.layout import EngineGroups, PagedViews
from tiercache.connector.vllm.plan import Job, Transfer
from tiercache.connector.vllm.put_queue import Put, PutQueue
from tiercache.connector.vllm.staging import StagingPool
from tiercache.errors import CircuitOpen, TierCacheError
from tiercache.prefix.delivered import DROPPED_BACKLOG, DROPPED_ERROR, Delivered
from tiercache.prefix.objects import CacheSpec, ObjectKind

log = logging.getLogger(__name__)

# How long a step in which vLLM computes nothing waits for loads still being fetched (a same-host fetch takes about a
# millisecond; a slow or remote one is reported at a later step instead of stalling the engine).
IDLE_FETCH_WAIT_S = 0.05
FLUSH_TIMEOUT_S = 10.0  # how long vLLM's exit waits for saves already gathered


@dataclass
class WorkerStats:
    """A worker's counters, as vLLM logs them (its KV-transfer line): every object that never reached a server is
    counted, in `saves_dropped` and by why (tiercache.prefix.delivered's reasons)."""

    loads_done: int = 0
    loads_failed: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    objects_saved: int = 0
    saves_dropped: int = 0
    saves_dropped_backlog: int = 0
    saves_dropped_unreachable: int = 0
    saves_dropped_refused: int = 0
    saves_dropped_error: int = 0
    saves_dropped_shutdown: int = 0


class Transfers:
    def __init__(self, client: Client, groups: EngineGroups, spec: CacheSpec,
                 max_pending_save_bytes: int = 1 << 30, save_batch_s: float = 0.05,
                 on_dropped: Callable[[Delivered], None] = lambda dropped: None) -> None:
        """`on_dropped`: told of every object that will not reach a server (the connector reports them)."""
        self.client = client
        self._on_dropped = on_dropped
        self.save_batch_s = save_batch_s
        self.groups = groups
        self.spec = spec  # this rank's: its namespace names this rank's shard of every object
        self.max_pending_save_bytes = max_pending_save_bytes
        self.stats = WorkerStats()
        self.views: PagedViews | None = None
        self._attention_sets: tuple[kernels.StatePools, ...] = ()  # prepared by register()
        self._state_sets: tuple[kernels.StatePools, ...] = ()
        self._loader: ThreadPoolExecutor | None = None  # made by register(), on cores vLLM does not compute on
        self._puts: PutQueue | None = None
        self._gatherer: ThreadPoolExecutor | None = None  # CPU step saves' copies, between the engine's steps
        self._gathers: list[Future] = []  # gathers the next step must wait for (vLLM's thread only)
        self._steps_fenced = False  # the engine calls before_step each step: gathers may run beside it
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._saved_finished: set[str] = set()
        self._load_stream = None
        self._save_stream = None
        self._save_staging: StagingPool | None = None
        self._load_staging: StagingPool | None = None
        self._namespaces: dict[str, str] = {}
        self._object_bytes: dict[tuple, int] = {}  # by pool key: every object of one kind is the same size
        self._fetches: list[_PendingLoad] = []  # loads started, not reported yet (vLLM's thread only)
        self._gathering: list[tuple[set[str], object]] = []  # end-of-request saves whose copies are in flight (CUDA)

    @property
    def save_staging(self) -> StagingPool | None:
        """The saves' staging buffers (made by register)."""
        return self._save_staging

    def register(self, views: PagedViews) -> None:
        self.views = views
        # Every pool set checked once (and on a GPU its kernel arguments uploaded): a step's copies skip that.
        self._attention_sets = tuple(kernels.state_pools(pools) for pools in views.attention)
        self._state_sets = tuple(kernels.state_pools(pools) for pools in views.states)
        # The fetching, gathering and putting threads run off the cores vLLM's CPU backend computes on (cores.py).
        elsewhere = off_compute_cores()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tiercache-load", initializer=elsewhere)
        self._gatherer = ThreadPoolExecutor(1, thread_name_prefix="tiercache-gather", initializer=elsewhere)
        cuda = views.device.type == "cuda"
        if cuda:
            self._load_stream = torch.cuda.Stream(views.device)
            self._save_stream = torch.cuda.Stream(views.device)
        self._save_staging = StagingPool(self.max_pending_save_bytes, pinned=cuda)
        self._puts = PutQueue(self.client, self._save_staging, self._saved, batch_s=self.save_batch_s,
                              on_start=elsewhere)
        self._load_staging = StagingPool(self.max_pending_save_bytes, pinned=cuda)

    # -- loads ---------------------------------------------------------------------------------------------------

    def start_loads(self, jobs: list[Job]) -> None:
        ready = None
        if self._load_stream is not None and jobs:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.views.device))  # after this step's block zeroing
        for job in jobs:
            self._fetches.append(_PendingLoad(job, ready, self._loader.submit(self._fetch, job)))

    def _fetch(self, job: Job) -> "_Fetched | None":
        """The job's objects' bytes, fetched into a staging buffer, an object per row of each pool set's part
        (background thread: network and shared memory, little Python), or None when the load failed."""
        sizes = [self.object_bytes(t) for t in job.transfers]
        staged = self._load_staging.take(sum(sizes))
        kept = staged is not None
        if staged is None:  # more than max_pending_save_bytes of loads at once: this one's buffer is not kept
            staged = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self._load_staging.pinned)
        rows = _ObjectRows(staged, sizes)
        try:
            fetched = self.client.get_many(self.namespace(job.salt), [t.ref.key for t in job.transfers],
                                           rows.buffers())
        except TierCacheError as exc:
            (log.debug if isinstance(exc, CircuitOpen) else log.warning)(
                "tiercache load for request %s failed, recomputing: %s", job.req_id, exc)
            fetched = None
        except BaseException:
            self._give_back_load(staged, kept)
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
            self._give_back_load(staged, kept)
            return None
        return _Fetched(rows, kept)

    def _give_back_load(self, staged: torch.Tensor, kept: bool) -> None:
        if kept:
            self._load_staging.give_back(staged)

    def _complete_loads(self, wait_s: float = 0.0, wait: bool = False) -> None:
        """Copy every fetched load into its blocks, on vLLM's thread (called each step, from results).
        `wait_s`: wait up to this long for fetches still running (a step in which vLLM computes nothing: the engine
        has nothing better to do, and a fetch thread that needs the GIL gets it while this thread sleeps);
        `wait`: for every started load to be fetched and copied.

        The copies run here and not on the fetching thread: vLLM's busy scheduling loop holds the GIL between
        steps, and each torch call a background thread makes waits for it again (a 4,096-token load spent ~130 ms
        copying on a thread, a few ms here: benchmarks/vllm_engine.py). On CUDA the copies go on the load stream and
        the load is reported once its event has completed."""
        if wait_s > 0 and self._fetches:
            futures_wait([p.fetch for p in self._fetches if p.copied is None], timeout=wait_s)
        still = []
        for pending in self._fetches:
            if pending.copied is None:
                if not (wait or pending.fetch.done()):
                    still.append(pending)
                    continue
                if not self._copy(pending):
                    self._finish_load(pending.job.req_id, False, 0)
                    continue
            if wait:
                pending.copied.synchronize()
            if pending.copied.query():
                self._give_back_load(pending.staged.rows.buffer, pending.staged.kept)
                self._finish_load(pending.job.req_id, True, pending.size)
            else:
                still.append(pending)
        self._fetches = still

    def _copy(self, pending: "_PendingLoad") -> bool:
        """Start copying a fetched load into its blocks; False when the load failed (fetch or copy)."""
        try:
            fetched = pending.fetch.result()
            if fetched is None:
                return False
            pending.staged = fetched
            pending.copied = self._scatter_job(pending.job, fetched.rows, pending.ready)
            pending.size = fetched.rows.total
            return True
        except Exception:  # a load must end reported, whatever went wrong; vLLM then recomputes
            log.exception("tiercache load for request %s failed", pending.job.req_id)
            if pending.staged is not None:
                self._give_back_load(pending.staged.rows.buffer, pending.staged.kept)
            return False

    def _scatter_job(self, job: Job, rows: "_ObjectRows", ready):
        """Copy a job's objects into their blocks; what marks the end of the copies (a CUDA event, or _COPIED)."""
        stream = self._load_stream
        if stream is None:
            for indices in _by_pools(job.transfers):
                self._scatter([job.transfers[i] for i in indices], rows.part(indices))
            return _COPIED
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for indices in _by_pools(job.transfers):
                self._scatter([job.transfers[i] for i in indices], rows.part(indices))
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _finish_load(self, req_id: str, ok: bool, size: int) -> None:
        with self._lock:
            (self._loaded if ok else self._failed).add(req_id)
            if ok:
                self.stats.loads_done += 1
                self.stats.bytes_loaded += size
            else:
                self.stats.loads_failed += 1

    def _scatter(self, transfers: list[Transfer], rows: torch.Tensor) -> None:
        """Objects that live in the same pools (one attention group's pages, or the states), one per row of `rows`,
        in one copy per pool set, not one per object: each torch call costs Python time on vLLM's thread."""
        blocks = list(zip(*(t.blocks for t in transfers)))  # per pool set: the block of every object
        for pools, pool_blocks, part in zip(self._pools(transfers[0]), blocks, self._columns(transfers[0], rows)):
            kernels.states_from_buffer(pools, self._slots(pool_blocks), part)

    # -- saves ---------------------------------------------------------------------------------------------------

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
        if self._save_stream is None and self._steps_fenced and not inline:
            self._save_jobs([job for job in jobs if job.finish])
            self._save_jobs([job for job in jobs if not job.finish], beside=True)
        else:
            self._save_jobs(jobs, inline=inline)

    def _save_jobs(self, jobs: list[Job], inline: bool = False, beside: bool = False) -> None:
        """One staging buffer and one put per namespace for `jobs`; `beside`: gathered on the gathering thread."""
        transfers = sorted(((job, t) for job in jobs for t in job.transfers), key=lambda item: _pool_key(item[1]))
        finished = {job.req_id for job in jobs if job.finish}
        if not transfers:
            self._finished_saving(finished, _COPIED)
            return
        sizes = [self.object_bytes(t) for _, t in transfers]
        staged = self._save_staging.take(sum(sizes))
        if staged is None:
            self._dropped({DROPPED_BACKLOG: len(transfers)})
            log.warning("tiercache: %d bytes of saves pending, dropping %d objects of %d requests",
                        self._save_staging.out_bytes, len(transfers), len(jobs))
            self._finished_saving(finished, _COPIED)  # nothing to copy: vLLM may free the blocks
            return
        rows = _ObjectRows(staged, sizes)
        by_namespace: dict[str, dict] = {}
        for (job, transfer), view in zip(transfers, rows.buffers()):
            engine = transfer.engine if self.spec.layout.tp_rank == 0 else None  # one copy serves every rank
            by_namespace.setdefault(self.namespace(job.salt), {})[transfer.ref] = \
                view if engine is None else WithEngineBlock(view, engine)
        objects = [t for _, t in transfers]
        if beside:
            self._gathers.append(self._gatherer.submit(self._gather_and_put, objects, rows, by_namespace))
            return
        try:
            gathered = self._gather_in_inference_mode(objects, rows)
        except BaseException:
            self._save_staging.give_back(staged)
            raise
        self._finished_saving(finished, gathered)
        put = Put(by_namespace, gathered, staged, rows.total)
        if inline:  # at exit: no other thread may run any more
            self._puts.send_now(put)
        else:
            self._puts.add(put)

    def _gather_in_inference_mode(self, transfers: list[Transfer], rows: "_ObjectRows"):
        # Inference mode as in vLLM's steps (the staging buffers are inference tensors once a step made them); a
        # flush at shutdown and the gathering thread run outside the steps.
        with torch.inference_mode():
            return self._gather_step(transfers, rows)

    def _gather_and_put(self, transfers: list[Transfer], rows: "_ObjectRows", by_namespace: dict) -> None:
        """The gathering thread's part of a CPU save: the copies, then the put handed to the saver thread (a slow
        server delays puts, never the next gather, which the engine waits for)."""
        try:
            gathered = self._gather_in_inference_mode(transfers, rows)
        except Exception:  # a save must never take the engine down
            log.exception("tiercache: gathering %d objects to save failed; they are not saved", len(transfers))
            self._dropped({DROPPED_ERROR: len(transfers)})
            self._save_staging.give_back(rows.buffer)
            return
        self._puts.add(Put(by_namespace, gathered, rows.buffer, rows.total))

    def _gather_step(self, transfers: list[Transfer], rows: "_ObjectRows"):
        """Copy the objects' bytes into their rows; what marks the end of the copies (a CUDA event, or _COPIED)."""
        stream = self._save_stream
        if stream is None:
            for indices in _by_pools(transfers):
                self._gather([transfers[i] for i in indices], rows.part(indices))
            return _COPIED
        current = torch.cuda.current_stream(self.views.device)
        stream.wait_stream(current)  # after this step's forward pass wrote the blocks
        with torch.cuda.stream(stream):
            for indices in _by_pools(transfers):
                self._gather([transfers[i] for i in indices], rows.part(indices))
            done = torch.cuda.Event()
            done.record(stream)
        if any(t.running for t in transfers):
            current.wait_event(done)  # the next step rewrites a running state: not before it is copied
        return done

    def _gather(self, transfers: list[Transfer], rows: torch.Tensor) -> None:
        blocks = list(zip(*(t.blocks for t in transfers)))
        for pools, pool_blocks, part in zip(self._pools(transfers[0]), blocks, self._columns(transfers[0], rows)):
            kernels.states_to_buffer(pools, self._slots(pool_blocks), part)

    def _finished_saving(self, req_ids: set[str], gathered) -> None:
        """End-of-request saves: vLLM may free the blocks once their bytes are copied out."""
        if not req_ids:
            return
        with self._lock:
            if gathered is _COPIED:
                self._saved_finished |= req_ids
            else:
                self._gathering.append((req_ids, gathered))

    def _saved(self, result: SaveResult) -> None:
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

    # -- results -------------------------------------------------------------------------------------------------

    def results(self, idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished loads, failed loads, finished end-of-request saves) since the last call. `idle`: vLLM computed
        nothing this step, so loads still being fetched are waited for (briefly) and reported now, not a step
        later."""
        self._complete_loads(wait_s=IDLE_FETCH_WAIT_S if idle else 0.0)
        with self._lock:
            still = []
            for req_ids, gathered in self._gathering:
                if gathered.query():
                    self._saved_finished |= req_ids
                else:
                    still.append((req_ids, gathered))
            self._gathering = still
            loaded, failed, saved = self._loaded, self._failed, self._saved_finished
            self._loaded, self._failed, self._saved_finished = set(), set(), set()
        return loaded | failed, failed, saved

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every started load (fetched and copied) and put (shutdown, tests); False when `timeout_s`
        passed first."""
        # (Waits on the futures already there: at interpreter exit the executors take no new work. A gather hands
        # its put to the put queue before it ends, so every put is queued once the gathers are done.)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if futures_wait(self._gathers, timeout=timeout_s).not_done:
            return False
        self._gathers = []
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._puts.flush(left):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if futures_wait([p.fetch for p in self._fetches], timeout=left).not_done:
            return False
        self._complete_loads(wait=True)
        return True

    def shutdown(self, flush_s: float = FLUSH_TIMEOUT_S) -> None:
        """Finish the saves already gathered (bounded: a hung server must not hang vLLM's exit), then stop."""
        if self.views is None:
            return
        if not self.drain(flush_s):
            log.warning("tiercache: saves still pending after %.0f s at shutdown are dropped", flush_s)
        self._puts.stop()
        for executor in (self._loader, self._gatherer):
            executor.shutdown(wait=False, cancel_futures=True)

    def namespace(self, salt: str) -> str:
        namespace = self._namespaces.get(salt)
        if namespace is None:
            namespace = self._namespaces[salt] = dataclasses.replace(self.spec, salt=salt).namespace
        return namespace

    # -- geometry ------------------------------------------------------------------------------------------------

    def object_bytes(self, transfer: Transfer) -> int:
        key = _pool_key(transfer)
        size = self._object_bytes.get(key)
        if size is None:
            size = self._object_bytes[key] = sum(pools.record_bytes for pools in self._pools(transfer))
        return size

    def _pools(self, transfer: Transfer) -> tuple[kernels.StatePools, ...]:
        """The byte pools an object's blocks live in: one attention group's pages (kv, tail), or one set of state
        pools per Mamba group (state). Both move with the same row copies (kernels.states_*): a page is a row."""
        if transfer.ref.kind is ObjectKind.STATE:
            return self._state_sets
        return (self._attention_sets[transfer.ref.group],)

    @staticmethod
    def _slots(blocks) -> torch.Tensor:
        """Block ids on the host, for CPU and CUDA pools alike: the kernels check them there and copy them with the
        launch, so neither vLLM's thread nor the copies' stream ever waits for the GPU (slots on the GPU would cost
        a synchronisation to check: the whole forward pass, for a save)."""
        return torch.tensor(blocks, dtype=torch.int64)

    def _columns(self, transfer: Transfer, rows: torch.Tensor) -> list[torch.Tensor]:
        """Objects' bytes, one per row, split per pool set: [objects, record bytes] each, a column of the rows when
        the object lives in several pool sets (the kernels take records spaced a row apart: no extra copy)."""
        parts, offset = [], 0
        for pools in self._pools(transfer):
            size = pools.record_bytes
            parts.append(rows[:, offset:offset + size])
            offset += size
        return parts


class _ObjectRows:
    """A staging buffer cut into objects' bytes, back to back in the order given. Objects of one kind (same size,
    same pools) that are consecutive form a [count, size] matrix the row copies take in one call."""

    def __init__(self, buffer: torch.Tensor, sizes: list[int]) -> None:
        self.buffer = buffer
        self.sizes = sizes
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.total = self.offsets[-1]

    def buffers(self) -> list[memoryview]:
        """Each object's bytes as a writable view (what the client fetches into, and puts from)."""
        whole = memoryview(self.buffer.numpy()).cast("B")
        return [whole[self.offsets[i]:self.offsets[i + 1]] for i in range(len(self.sizes))]

    def part(self, indices: list[int]) -> torch.Tensor:
        """The rows of objects `indices` (consecutive, of one size) as one [count, size] tensor."""
        first, size = indices[0], self.sizes[indices[0]]
        return self.buffer[self.offsets[first]:self.offsets[first] + size * len(indices)].view(len(indices), size)


class _CopiedOnHost:
    """What a finished host-side copy looks like to _complete_loads: a CUDA event that has already completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_COPIED = _CopiedOnHost()


@dataclass
class _Fetched:
    rows: _ObjectRows
    kept: bool  # the staging buffer goes back to the pool (else it was made for this load only)


@dataclass
class _PendingLoad:
    job: Job
    ready: object  # CUDA event: this step's block zeroing is done (None on CPU)
    fetch: object  # Future of the fetched rows (its result is None when the load failed)
    copied: object = None  # once copying started: the CUDA event of the copies, or _COPIED
    staged: _Fetched | None = None
    size: int = 0


def _by_pools(transfers) -> list[list[int]]:
    """Runs of consecutive objects that live in the same pools (the states, or one attention group's pages): each
    run is one copy per pool set. The planner lists a job's objects kind by kind, so runs are long."""
    runs: list[list[int]] = []
    previous = None
    for index, transfer in enumerate(transfers):
        key = _pool_key(transfer)
        if key != previous:
            runs.append([])
            previous = key
        runs[-1].append(index)
    return runs


def _pool_key(transfer: Transfer) -> tuple:
    """Which pools an object lives in: the states (-1), or one attention group's pages (its group)."""
    return (-1,) if transfer.ref.kind is ObjectKind.STATE else (transfer.ref.group,)
