"""tiercache as a vLLM KV connector (vLLM 0.33, V1 engine, hybrid memory allocator):

    vllm serve Qwen/Qwen3.5-0.8B --enable-prefix-caching \\
        --prefix-match-unit 16 --prefix-cache-retention-interval 544 \\
        --kv-transfer-config '{"kv_connector": "TierCacheConnector",
                               "kv_connector_module_path": "tiercache.connector.vllm",
                               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"url": "grpc://127.0.0.1:50051"}}'

`kv_connector_extra_config` keys (all optional): the connection's (tiercache.client.settings: `url`, `token`,
`tls_ca_file`, `tls_cert_file`, `tls_key_file`, `tls_server_name`, each defaulting to its environment variable), and
vLLM's own: `model_name` (default: the served model), `revision`, `match_unit` (u, default 16 when it divides the
block size, else the block size), `salt`, `weights_id`, `timeout_s`, `lookup_timeout_s`, `offline_backoff_s`,
`max_pending_save_bytes`, `save_batch_s`, `max_boundary_states`. Prefix caching (on by default) puts the Mamba
groups in the 'align' mode the connector needs; `--mamba-cache-mode` decides nothing (deprecated in 0.33; 0.32 derives
the mode from prefix caching). A configuration the connector cannot serve (prefix caching off, unknown keys, ...) is
refused while vLLM validates it, before the engine core starts (tiercache.connector.vllm.preflight; `tiercache
check-vllm` says the same from vLLM's flags). At startup the scheduler's connector checks that its largest object fits
the server's chunk limit (tiercache.connector.limits).

The class hands vLLM's calls to the side its role makes: `scheduler_side` (lookups, and the Planner of
tiercache.connector.vllm.plan: what is loaded, what is saved, when) or `worker_side` (this rank's two directions,
tiercache.connector.vllm.loads and .saves). What both build alike (settings, vLLM's groups, the layout and its
namespace's identity, the cache spec) is `engine_setup`.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.client import Client
from tiercache.connector.delivery import DeliveryReporter
from tiercache.connector.pod_registration import PodRegistration
from tiercache.connector.vllm.engine_setup import EngineSetup, engine_setup
from tiercache.connector.vllm.loads import Loads
from tiercache.connector.vllm.logs import join_vllm_log
from tiercache.connector.vllm.plan import Planner, StepPlan
from tiercache.connector.vllm.saves import Saves
from tiercache.connector.vllm.scheduler_side import SchedulerSide
from tiercache.connector.vllm.worker_side import WorkerSide
from tiercache.connector.vllm.worker_stats import WorkerStats

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 1.0  # how often a connector reports its counters' changes to vLLM

# Scheduler-role connectors of this process. With vLLM's engine core in the process that computes (the `uni`
# executor and VLLM_ENABLE_V1_MULTIPROCESSING=0, e.g. an offline `LLM`), a request's end-of-request save reaches the
# worker with the next step's metadata, and a process that exits after its last request runs no next step: the
# worker role takes those saves from here when it shuts down (vLLM shuts the workers down first, blocks still held).
_SCHEDULERS: "weakref.WeakSet[TierCacheConnector]" = weakref.WeakSet()


class TierCacheMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class TierCacheStats(KVConnectorStats):
    """Counters since the last report (lookups and planned saves from the scheduler, transfers from workers)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierCacheStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's calls, handed to the side of the connector that vLLM's role for it needs: the scheduler side
    (scheduler_side: lookups and plans) or a worker side (worker_side: this rank's loads and saves)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        join_vllm_log()  # before anything is logged, a refusal included
        super().__init__(vllm_config, role, kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        setup = engine_setup(vllm_config, kv_cache_config, worker=not scheduler)
        self.settings, self.groups, self.layout, self.spec = setup.settings, setup.groups, setup.layout, setup.spec
        self._scheduler_side = SchedulerSide(setup, vllm_config) if scheduler else None
        self._worker_side = None if scheduler else WorkerSide(setup)
        self._reported: dict[str, int] = {}
        self._reported_at = float("-inf")
        if scheduler:
            _SCHEDULERS.add(self)
        _say_started(role, setup, vllm_config.cache_config.prefix_match_unit)

    @property
    def _side(self) -> SchedulerSide | WorkerSide:
        """The side this connector's role made (each has its counters, its delivery reporter and `close`)."""
        return self._scheduler_side or self._worker_side

    @property
    def planner(self) -> Planner | None:
        """The scheduler half (None in a worker)."""
        return self._scheduler_side.planner if self._scheduler_side is not None else None

    @property
    def pod_registration(self) -> PodRegistration | None:
        """The scheduler's registration for KV events (None without `events_pod_id`, and in a worker)."""
        return self._scheduler_side.registration if self._scheduler_side is not None else None

    @property
    def client(self) -> Client | None:
        """The worker's client (None in the scheduler)."""
        return self._worker_side.client if self._worker_side is not None else None

    @property
    def loads(self) -> Loads | None:
        """The worker's loads (None in the scheduler)."""
        return self._worker_side.loads if self._worker_side is not None else None

    @property
    def saves(self) -> Saves | None:
        """The worker's saves (None in the scheduler)."""
        return self._worker_side.saves if self._worker_side is not None else None

    @property
    def worker_stats(self) -> WorkerStats | None:
        """The worker's transfer counters (None in the scheduler, whose counters are `planner.stats`)."""
        return self._worker_side.stats if self._worker_side is not None else None

    @property
    def delivery(self) -> DeliveryReporter:
        """What this role reports to the server's delivered-hit counters (tiercache.connector.delivery)."""
        return self._side.delivery

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never a wrong answer

    # -- scheduler side ------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side.planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler_side.planner.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return TierCacheMetadata(self._scheduler_side.planner.plan_step(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        self._scheduler_side.loads_reported(set(connector_output.finished_recving or ()), failed)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.planner.finished(request, block_ids), None

    # -- worker side ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker_side.register(self._kv_cache_config, kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """vLLM calls this first thing in every step, before it writes a block: the last step's saves must have been
        copied out by now (on CPU they are copied beside the engine, between steps)."""
        self._worker_side.saves.before_step()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker_side.loads.start(self._get_connector_metadata().plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous and finish before vLLM schedules the request."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing per layer: wait_for_save gathers every layer of a chunk in one kernel launch."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker_side.saves.save(self._get_connector_metadata().plan.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        ended = self._worker_side.ended(idle=self.has_connector_metadata() and self._get_connector_metadata().plan.idle)
        return KVConnectorTransferResults(finished_sending=ended.saved, finished_recving=ended.loads.ended,
                                          failed_recving=ended.loads.failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Always empty: a failed load is reported for its whole request (failed_recving), which vLLM 0.33 requires
        for hybrid layouts (block ids are per group there) and treats alike for one group: recompute the request."""
        return set()

    def drain(self, timeout_s: float | None = None) -> bool:
        """A worker: wait for every gather and put, then every started load (shutdown, tests); False when
        `timeout_s` passed first."""
        return self._worker_side.drain(timeout_s)

    # -- both ----------------------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> TierCacheStats | None:
        """What changed since the last report (the counters themselves stay cumulative, for logs and tests), at most
        every STATS_INTERVAL_S: vLLM asks every step, and a worker's report travels to the engine core with the step's
        output (pickled, every step), while vLLM only logs the sums every few seconds."""
        now = time.monotonic()
        if now - self._reported_at < STATS_INTERVAL_S:
            return None
        self._reported_at = now
        totals = vars(self._side.stats).copy()  # (plain int counters: no deep copy each step)
        changed = {name: value - self._reported.get(name, 0) for name, value in totals.items()}
        self._reported = totals
        stats = TierCacheStats(data=changed)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierCacheStats:
        return TierCacheStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker_side is not None and self._worker_side.saves.registered:
            for scheduler in list(_SCHEDULERS):  # in-process engine core: saves no later step will deliver
                if scheduler._vllm_config is self._vllm_config:
                    self._worker_side.save_at_exit(scheduler._scheduler_side.take_finishes())
        self._side.close()


def _say_started(role: KVConnectorRole, setup: EngineSetup, vllm_unit: int | None) -> None:
    """The connector's start line (tests and the lab read its namespace, N and u) and, in the scheduler of a hybrid
    engine whose vLLM hashes prompts only every block, why its hits end on block boundaries."""
    spec, block = setup.spec, setup.groups.block_size
    log.info("TierCacheConnector (%s) on %s: namespace %s, N=%d, u=%d", role.name, setup.settings.connection.url,
             spec.namespace, block, spec.match_unit)
    if role == KVConnectorRole.SCHEDULER and setup.groups.mamba and (vllm_unit or block) >= block:
        log.warning("TierCacheConnector: vLLM hashes prompts every %d tokens, its block size N: it keeps no "
                    "recurrent state below a block, so prompts shorter than N=%d get no hit and hits end on "
                    "block boundaries. Start vLLM with --prefix-match-unit 16.", vllm_unit or block, block)
