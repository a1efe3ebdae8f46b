"""TierCacheTier: tiercache as a secondary tier of vLLM's KV offloading (vLLM 0.32 and 0.33, one class).

vLLM's `TieringOffloadingSpec` keeps KV chunks in its own CPU pool (the primary tier) and hands each newly stored
chunk to its secondary tiers (a cascade: `submit_store`), and asks them, in order, for a chunk it does not hold
(`lookup`, then `submit_load` into a fresh pool slot: a promotion). Every call comes on the engine core's scheduler
(0.33: under the tiering manager's lock, possibly from its poll thread), and none may block: lookups are answered by
`verdicts.Verdicts`, jobs run on `transfers.Transfers`' threads. The tier's own state is behind those objects' locks,
so any thread may call it.

Nothing here needs the server up: an unreachable server makes lookups misses and jobs failures until the client's
breaker sees it answer again (no engine restart).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiercache.client import BreakerPolicy, Client, RetryPolicy
from tiercache.connector.limits import check_fits
from tiercache.connector.vllm.cores import born_off_compute_cores
from tiercache.connector.vllm_tier.namespace import namespace
from tiercache.connector.vllm_tier.settings import TIER_CLASS, TierSettings
from tiercache.connector.vllm_tier.transfers import Job, Transfers
from tiercache.connector.vllm_tier.verdicts import Verdict, Verdicts

log = logging.getLogger(__name__)

_ANSWERS = {Verdict.HIT: LookupResult.HIT, Verdict.MISS: LookupResult.MISS, Verdict.RETRY: LookupResult.RETRY}


class TierCacheTier(SecondaryTierManager):
    # Safe from any thread (module docstring): 0.33 may then poll finished jobs between engine steps.
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, locality=None, **tier_kwargs: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = locality
        self.settings = TierSettings.from_tier_kwargs(tier_kwargs)
        self._config = offloading_spec.config
        self._rows = primary_kv_view.cast("B")
        self._namespace: str | None = None
        self._namespace_lock = threading.Lock()
        settings = self.settings
        breaker = BreakerPolicy.probing_at_most(settings.offline_backoff_s)
        # Born off the cores a CPU engine computes on (their threads, and gRPC's, inherit that).
        self._client, self._lookup_client, self._verdicts, self._transfers = born_off_compute_cores(
            lambda: self._start(breaker))
        check_fits(self._client, self.block_size_bytes, f"{TIER_CLASS}: a chunk of {self._config.model.name} "
                                                        f"({self._config.cache.blocks_per_chunk} blocks, every rank)")
        log.info("%s (%s) on %s: chunks of %d bytes, %d I/O threads", TIER_CLASS, tier_type, settings.connection.url,
                 self.block_size_bytes, settings.io_threads)

    def _start(self, breaker: BreakerPolicy) -> tuple[Client, Client, Verdicts, Transfers]:
        settings = self.settings
        client = Client(settings.connection, timeout_s=settings.timeout_s, retry=RetryPolicy(attempts=2),
                        breaker=breaker)
        # Lookups: one try within the deadline (a late answer is a miss anyway).
        lookups = Client(settings.connection, timeout_s=settings.lookup_deadline_s, retry=RetryPolicy(attempts=1),
                         breaker=breaker)
        verdicts = Verdicts(lambda keys: lookups.exists(self.namespace, keys), settings.lookup_deadline_s)
        transfers = Transfers(client, lambda: self.namespace, self._slot, self.block_size_bytes, settings.io_threads,
                              settings.max_pending_store_bytes, verdicts.known_present)
        return client, lookups, verdicts, transfers

    @property
    def namespace(self) -> str:
        """Resolved on first use: vLLM seeds its block hashes (NONE_HASH) after it makes its tiers."""
        if self._namespace is None:
            with self._namespace_lock:
                if self._namespace is None:
                    self._namespace = namespace(self._config, self.settings.model_identity, self.block_size_bytes,
                                                self.settings.salt, self.settings.attention_backend)
                    log.info("%s: namespace %s", TIER_CLASS, self._namespace)
        return self._namespace

    def _slot(self, index: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[index * size:(index + 1) * size]

    # -- vLLM's calls -------------------------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _ANSWERS[self._verdicts.lookup(bytes(key), req_context.req_id)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._transfers.submit(_job(job_metadata, load=False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._transfers.submit(_job(job_metadata, load=True))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for done in self._transfers.finished():
            if done.load and done.failed:
                self._verdicts.load_failed(done.failed)
            elif not done.load and done.ok:
                self._verdicts.stored(done.ok)
            partial = done.load and done.ok and done.failed
            results.append(JobResult(done.job_id, success=not done.failed,
                                     successful_keys=[OffloadKey(k) for k in done.ok] if partial else None,
                                     transfer_time=done.seconds, transfer_bytes=done.nbytes))
        return results

    def has_pending_work(self) -> bool:
        return self._transfers.pending()

    def drain_jobs(self) -> None:
        self._transfers.drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._verdicts.request_finished(req_context.req_id)

    def shutdown(self) -> None:
        # What it did, in the engine's log: a served engine's tier is out of reach of any other reader (a shared
        # tier answering fewer hits than another is read from `timed_out`: lookups the server answered too late).
        log.info("%s: at shutdown %s", TIER_CLASS, " ".join(f"{k}={v}" for k, v in self.counts().items()))
        self._transfers.close()
        self._verdicts.close()
        self._lookup_client.close()
        self._client.close()
        self._rows.release()  # vLLM closes its pool's mmap after its tiers: no view of it may be left

    # -- what it did --------------------------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """The tier's own counters (lookups asked and answered, chunks stored, loaded, failed, shed)."""
        from dataclasses import asdict

        return {**asdict(self._verdicts.counts), **asdict(self._transfers.counts)}

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("server",)

    def config_info(self):
        return {"server": self.settings.connection.url}


def _job(job: TransferJob, load: bool) -> Job:
    return Job(job.job_id, [bytes(k) for k in job.keys], [int(c) for c in job.chunk_ids], load)
