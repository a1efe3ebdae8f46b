"""The vLLM connector in a worker's process: its client (made off vLLM's compute cores), this rank's Loads and Saves
over vLLM's paged caches, their counters, and the reporter of saves dropped before they reached a server.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from tiercache.client import BreakerPolicy, Client
from tiercache.connector.delivery import DeliveryReporter
from tiercache.connector.vllm.cores import born_off_compute_cores, off_compute_cores
from tiercache.connector.vllm.engine_setup import EngineSetup
from tiercache.connector.vllm.layout import PoolSets, paged_views
from tiercache.connector.vllm.loads import Loads, LoadsEnded
from tiercache.connector.vllm.plan import Job
from tiercache.connector.vllm.salts import namespaces
from tiercache.connector.vllm.saves import Saves
from tiercache.connector.vllm.worker_stats import WorkerStats

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0  # how long vLLM's exit waits for saves already gathered


class TransfersEnded(NamedTuple):
    """What ended since vLLM last asked (its get_transfer_results)."""

    saved: set[str]  # requests whose end-of-request saves are copied out: vLLM may free their blocks
    loads: LoadsEnded


class WorkerSide:
    def __init__(self, setup: EngineSetup) -> None:
        settings = setup.settings
        breaker = BreakerPolicy.probing_at_most(settings.offline_backoff_s)
        # Made off the compute cores: gRPC's threads, born with the process's first channel, would otherwise take
        # their CPU time from the forward pass (cores.py).
        self.client = born_off_compute_cores(
            lambda: Client(settings.connection, timeout_s=settings.timeout_s, breaker=breaker))
        self.delivery = DeliveryReporter(self.client, setup.spec.namespace)
        self.stats = WorkerStats()
        self._groups = setup.groups
        rank_namespaces = namespaces(setup.spec)  # this rank's, per salt: loads and saves name the same
        self.loads = Loads(self.client, rank_namespaces, settings.max_pending_save_bytes, self.stats)
        self.saves = Saves(self.client, rank_namespaces, settings.max_pending_save_bytes, self.stats,
                           engine_blocks=setup.layout.tp_rank == 0, batch_s=settings.save_batch_s,
                           on_dropped=self.delivery.add)

    def register(self, kv_cache_config, kv_caches: dict) -> None:
        """vLLM's caches are allocated: loads and saves copy into and out of them from now on."""
        pools = PoolSets(paged_views(self._groups, kv_cache_config, kv_caches))
        # The fetching, gathering and putting threads run off the cores vLLM's CPU backend computes on (cores.py).
        elsewhere = off_compute_cores()
        self.loads.register(pools, elsewhere)
        self.saves.register(pools, elsewhere)

    def ended(self, idle: bool) -> TransfersEnded:
        """Copy the loads fetched into their blocks and say what ended; `idle`: vLLM computes nothing this step
        (Loads.ended)."""
        loads = self.loads.ended(idle=idle)
        return TransfersEnded(self.saves.finished(), loads)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every gather and put, then every started load (shutdown, tests); False when `timeout_s` passed
        first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self.saves.drain(deadline) and self.loads.drain(deadline)

    def save_at_exit(self, jobs: list[Job]) -> None:
        """Save now, on this thread: end-of-request saves no later step will deliver (shutdown)."""
        self.saves.save(jobs, inline=True)

    def close(self) -> None:
        if self.saves.registered:
            # Finish the saves already gathered, bounded: a hung server must not hang vLLM's exit.
            if not self.drain(FLUSH_TIMEOUT_S):
                log.warning("tiercache: saves still pending after %.0f s at shutdown are dropped", FLUSH_TIMEOUT_S)
            self.saves.stop()
            self.loads.stop()
        self.delivery.close()
        self.client.close()
