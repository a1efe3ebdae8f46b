"""The worker half of the vLLM connector: bytes between vLLM's paged cache and tiercache, with tiercache.kernels.

Objects are whole blocks as vLLM keeps them (see tiercache.connector.vllm.layout): a kv or tail object is one
attention group's page of one block, for all its layers; a state object is every Mamba layer's state bytes of one
block per Mamba group.

Loads fetch on a background thread (and check sizes); the copies into the request's blocks run on vLLM's own thread
at the next step boundary, and the load is reported when they are done. Any missing, corrupt (the server never
returns a chunk that fails its checksum) or mis-sized object fails the whole load, and vLLM recomputes the request:
a partial load is never reported as a hit.

Saves are gathered when the step's forward pass is over (`wait_for_save`: the blocks still hold what the plan names)
into host memory, and put on a second background thread, so the engine waits for copies, not for the network. Saves
beyond `max_pending_save_bytes` are dropped with a warning: a cache may forget, an engine must not stall.

On CUDA tensors the copies are the CUDA kernels, staged through pinned host memory, loads on their own stream; on
CPU tensors they are the kernels' torch reference.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

from tiercache import kernels
from tiercache.client import Client
from tiercache.connector.prefix_cache import save_objects
from tiercache.connector.vllm.layout import EngineGroups, PagedViews
from tiercache.connector.vllm.plan import Job, Transfer
from tiercache.errors import CircuitOpen, TierCacheError
from tiercache.prefix.objects import CacheSpec, ObjectKind

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    loads_done: int = 0
    loads_failed: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    objects_saved: int = 0
    saves_dropped: int = 0


class Transfers:
    def __init__(self, client: Client, groups: EngineGroups, spec: CacheSpec,
                 max_pending_save_bytes: int = 1 << 30) -> None:
        self.client = client
        self.groups = groups
        self.spec = spec  # this rank's: its namespace names this rank's shard of every object
        self.max_pending_save_bytes = max_pending_save_bytes
        self.stats = WorkerStats()
        self.views: PagedViews | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tiercache-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tiercache-save")
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._saved_finished: set[str] = set()
        self._pending_save_bytes = 0
        self._load_stream = None
        self._namespaces: dict[str, str] = {}
        self._fetches: list[_PendingLoad] = []  # loads started, not reported yet (vLLM's thread only)

    def register(self, views: PagedViews) -> None:
        self.views = views
        if views.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(views.device)

    # -- loads ---------------------------------------------------------------------------------------------------

    def start_loads(self, jobs: list[Job]) -> None:
        ready = None
        if self._load_stream is not None and jobs:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.views.device))  # after this step's block zeroing
        for job in jobs:
            self._fetches.append(_PendingLoad(job, ready, self._loader.submit(self._fetch, job)))

    def _fetch(self, job: Job) -> list | None:
        """The job's objects' bytes (background thread: network and shared memory, little Python), or None."""
        try:
            fetched = self.client.fetch_many(self.namespace(job.salt), [t.ref.key for t in job.transfers])
        except TierCacheError as exc:
            (log.debug if isinstance(exc, CircuitOpen) else log.warning)(
                "tiercache load for request %s failed, recomputing: %s", job.req_id, exc)
            return None
        for transfer, item in zip(job.transfers, fetched):
            if item is None or len(item.data) != self.object_bytes(transfer):
                log.warning("tiercache load for request %s: object at %d (%s) is %s; recomputing", job.req_id,
                            transfer.ref.position, transfer.ref.kind.name,
                            "gone" if item is None else f"{len(item.data)} bytes, not {self.object_bytes(transfer)}")
                return None
        return [item.data for item in fetched]

    def _complete_loads(self, wait: bool = False) -> None:
        """Copy every fetched load into its blocks, on vLLM's thread (called each step, from results); `wait`: for
        every started load to be fetched and copied.

        The copies run here and not on the fetching thread: vLLM's busy scheduling loop holds the GIL between
        steps, and each torch call a background thread makes waits for it again (a 4,096-token load spent ~130 ms
        copying on a thread, a few ms here: benchmarks/vllm_engine.py). On CUDA the copies go on the load stream and
        the load is reported once its event has completed."""
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
                self._finish_load(pending.job.req_id, True, pending.size)
            else:
                still.append(pending)
        self._fetches = still

    def _copy(self, pending: "_PendingLoad") -> bool:
        """Start copying a fetched load into its blocks; False when the load failed (fetch or copy)."""
        try:
            payloads = pending.fetch.result()
            if payloads is None:
                return False
            pending.copied = self._scatter_job(pending.job, payloads, pending.ready)
            pending.size = sum(len(p) for p in payloads)
            return True
        except Exception:  # a load must end reported, whatever went wrong; vLLM then recomputes
            log.exception("tiercache load for request %s failed", pending.job.req_id)
            return False

    def _scatter_job(self, job: Job, payloads: list, ready):
        """Copy a job's objects into their blocks; what marks the end of the copies (a CUDA event, or _COPIED)."""
        stream = self._load_stream
        if stream is None:
            for transfers, group in _by_pools(job.transfers, payloads):
                self._scatter(transfers, group)
            return _COPIED
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for transfers, group in _by_pools(job.transfers, payloads):
                self._scatter(transfers, group)
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

    def _scatter(self, transfers: list[Transfer], payloads: list) -> None:
        """Every object that lives in the same pools (one attention group's pages, or the states) in one copy per
        pool set, not one per object: each torch call costs Python time on vLLM's thread."""
        rows = np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in payloads]).reshape(len(payloads), -1)
        buffer = self._staged(torch.from_numpy(rows))
        blocks = list(zip(*(t.blocks for t in transfers)))  # per pool set: the block of every object
        for pools, pool_blocks, part in zip(self._pools(transfers[0]), blocks, self._columns(transfers[0], buffer)):
            kernels.states_from_buffer(pools, self._slots(list(pool_blocks)), part)

    # -- saves ---------------------------------------------------------------------------------------------------

    def save(self, jobs: list[Job]) -> None:
        """Gather every job's objects now (the blocks hold them until this step ends), put them in the background."""
        for job in jobs:
            payloads = {t.ref: self._gather(t) for t in job.transfers}
            if self.views.device.type == "cuda":
                torch.cuda.current_stream(self.views.device).synchronize()
            if job.finish:
                with self._lock:
                    self._saved_finished.add(job.req_id)  # vLLM may free the blocks now: the bytes are ours
            size = sum(len(p) for p in payloads.values())
            with self._lock:
                if self._pending_save_bytes + size > self.max_pending_save_bytes:
                    self.stats.saves_dropped += len(payloads)
                    log.warning("tiercache: %d bytes of saves pending, dropping %d objects of request %s",
                                self._pending_save_bytes, len(payloads), job.req_id)
                    continue
                self._pending_save_bytes += size
            self._saver.submit(self._put, self.namespace(job.salt), payloads, size)

    def _put(self, namespace: str, payloads: dict, size: int) -> None:
        try:
            result = save_objects(self.client, namespace, {ref: memoryview(p) for ref, p in payloads.items()})
        except Exception:  # a save must never take the engine down
            log.exception("tiercache save of %d objects failed", len(payloads))
            result = None
        with self._lock:
            self._pending_save_bytes -= size
            if result is not None:
                self.stats.objects_saved += result.objects
                self.stats.bytes_saved += sum(result.bytes_by_tier.values())

    def _gather(self, transfer: Transfer) -> np.ndarray:
        payload = self._host_buffer(self.object_bytes(transfer))
        for pools, block, buffer in zip(self._pools(transfer), transfer.blocks, self._parts(transfer, payload)):
            kernels.states_to_buffer(pools, self._slots([block]), buffer)
        return payload.numpy()

    # -- results -------------------------------------------------------------------------------------------------

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished loads, failed loads, finished end-of-request saves) since the last call."""
        self._complete_loads()
        with self._lock:
            loaded, failed, saved = self._loaded, self._failed, self._saved_finished
            self._loaded, self._failed, self._saved_finished = set(), set(), set()
        return loaded | failed, failed, saved

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every started load (fetched and copied) and put (shutdown, tests); False when `timeout_s`
        passed first."""
        try:
            self._loader.submit(lambda: None).result(timeout_s)
            self._saver.submit(lambda: None).result(timeout_s)
        except FutureTimeout:
            return False
        self._complete_loads(wait=True)
        return True

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)

    def namespace(self, salt: str) -> str:
        namespace = self._namespaces.get(salt)
        if namespace is None:
            namespace = self._namespaces[salt] = dataclasses.replace(self.spec, salt=salt).namespace
        return namespace

    # -- geometry ------------------------------------------------------------------------------------------------

    def object_bytes(self, transfer: Transfer) -> int:
        return sum(kernels.state_record_bytes(pools) for pools in self._pools(transfer))

    def _pools(self, transfer: Transfer) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The byte pools an object's blocks live in: one attention group's pages (kv, tail), or one set of state
        pools per Mamba group (state). Both move with the same row copies (kernels.states_*): a page is a row."""
        if transfer.ref.kind is ObjectKind.STATE:
            return self.views.states
        return (self.views.attention[transfer.ref.group],)

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64, device=self.views.device)

    def _parts(self, transfer: Transfer, payload: torch.Tensor) -> list[torch.Tensor]:
        """The object's bytes split per pool set, each [1, record bytes] as the row copies take it."""
        return self._columns(transfer, payload.view(1, -1))

    def _columns(self, transfer: Transfer, rows: torch.Tensor) -> list[torch.Tensor]:
        """Objects' bytes, one per row, split per pool set: [objects, record bytes] each, contiguous."""
        parts, offset = [], 0
        for pools in self._pools(transfer):
            size = kernels.state_record_bytes(pools)
            part = rows[:, offset:offset + size]
            parts.append(part if part.is_contiguous() else part.contiguous())
            offset += size
        return parts

    def _host_buffer(self, size: int) -> torch.Tensor:
        pinned = self.views.device.type == "cuda"
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

    def _staged(self, payload: torch.Tensor) -> torch.Tensor:
        """Host bytes where the copy kernels can read them: pinned memory for CUDA caches."""
        if self.views.device.type == "cuda":
            return payload.pin_memory()
        return payload


class _CopiedOnHost:
    """What a finished host-side copy looks like to _complete_loads: a CUDA event that has already completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_COPIED = _CopiedOnHost()


@dataclass
class _PendingLoad:
    job: Job
    ready: object  # CUDA event: this step's block zeroing is done (None on CPU)
    fetch: object  # Future of the fetched payloads (its result is None when the load failed)
    copied: object = None  # once copying started: the CUDA event of the copies, or _COPIED
    size: int = 0


def _by_pools(transfers, payloads) -> list[tuple[list[Transfer], list]]:
    """Objects grouped by the pools they live in: the states, and each attention group's pages."""
    groups: dict[tuple, tuple[list, list]] = {}
    for transfer, payload in zip(transfers, payloads):
        key = ("state",) if transfer.ref.kind is ObjectKind.STATE else ("attention", transfer.ref.group)
        members = groups.setdefault(key, ([], []))
        members[0].append(transfer)
        members[1].append(payload)
    return list(groups.values())
