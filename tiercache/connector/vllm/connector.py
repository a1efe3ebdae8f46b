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
the server's chunk limit (tiercache.connector.limits). The rules (what is loaded, what is saved,
when) are in tiercache.connector.vllm.plan; the worker's two directions in tiercache.connector.vllm.loads and .saves;
the namespace's identity in tiercache.connector.vllm.identity.
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

from tiercache.client import BreakerPolicy, Client, RetryPolicy
from tiercache.client.client import PodEndpoints
from tiercache.connector.delivery import DeliveryReporter
from tiercache.connector.limits import check_spec
from tiercache.connector.pod_registration import PodRegistration
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.connector.vllm.identity import engine_identity
from tiercache.connector.vllm.cores import born_off_compute_cores, off_compute_cores
from tiercache.connector.vllm.layout import PoolSets, engine_groups, model_layout, paged_views
from tiercache.connector.vllm.loads import Loads
from tiercache.connector.vllm.logs import join_vllm_log
from tiercache.connector.vllm.plan import Planner, StepPlan
from tiercache.connector.vllm.preflight import choices_of, refuse
from tiercache.connector.vllm.salts import namespaces
from tiercache.connector.vllm.saves import Saves
from tiercache.connector.vllm.settings import VllmSettings
from tiercache.connector.vllm.worker_stats import WorkerStats
from tiercache.errors import InvalidArgument
from tiercache.prefix.objects import CacheSpec

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 1.0  # how often a connector reports its counters' changes to vLLM
FLUSH_TIMEOUT_S = 10.0  # how long vLLM's exit waits for saves already gathered

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
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        join_vllm_log()  # before anything is logged, a refusal included
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise InvalidArgument("TierCacheConnector needs vLLM's KVCacheConfig, which vLLM 0.32 and 0.33 pass to "
                                  "connectors (an older vLLM does not)")
        # What vLLM let us refuse before its engine core started (preflight.refuse_early), said again here for the
        # starts where vLLM resolved this class no earlier.
        refuse(choices_of(vllm_config))
        settings = VllmSettings.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.settings = settings
        self.groups = engine_groups(kv_cache_config)
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        # Each worker loads and saves its own rank's shard; the scheduler's lookup asks for every rank's shards, so
        # a hit is one every rank can load (a shard gone between lookup and load fails that rank's load, and vLLM
        # recomputes the request: never a mix of prefixes).
        tp_rank = _tensor_parallel_rank() if role == KVConnectorRole.WORKER else 0
        self.layout = model_layout(self.groups, kv_cache_config, settings.model_name or model.served_model_name
                                   or model.model, settings.revision or model.revision or "main",
                                   tp_rank=tp_rank, tp_size=parallel.tensor_parallel_size,
                                   identity=engine_identity(vllm_config, self.groups, settings.weights_id,
                                                                   kv_cache_config))
        block = self.groups.block_size
        unit = settings.match_unit or (16 if block % 16 == 0 else block)
        self.spec = CacheSpec(self.layout, block, unit, salt=settings.salt,
                              max_boundary_states=settings.max_boundary_states)
        breaker = BreakerPolicy.probing_at_most(settings.offline_backoff_s)
        self.client: Client | None = None  # the worker's
        self._planner: Planner | None = None
        self._loads: Loads | None = None
        self._saves: Saves | None = None
        self.worker_stats = WorkerStats()
        self._reported: dict[str, int] = {}
        self._reported_at = float("-inf")
        self._registration: PodRegistration | None = None
        if role == KVConnectorRole.SCHEDULER:
            # One try within a short deadline: a lookup that cannot be answered quickly is a miss, not a stall, and
            # the breaker makes every later one an instant miss until the server answers again. The server counts
            # the lookup itself (no second call for statistics).
            lookups = Client(settings.connection, timeout_s=settings.lookup_timeout_s, retry=RetryPolicy(attempts=1),
                             breaker=breaker)
            # Every rank's objects are the same size: the scheduler checks them once, before the engine serves.
            check_spec(lookups, self.spec, "TierCacheConnector")
            # With events, every lookup names the pod: its answer says whether the server still knows it.
            cache = PrefixCache(lookups, self.spec, all_ranks=True, pod_id=settings.events_pod_id or "")
            if settings.events_pod_id:
                self._registration = self._pod_registration(settings.events_pod_id,
                                                            model.served_model_name or model.model,
                                                            cache.rank_namespaces(), parallel.data_parallel_rank)
                self._registration.register()
            # Token ids and vLLM's hashes go with the kv saves only for an engine that has the server publish its KV
            # events: elsewhere they would cost the scheduler's step and the worker's metadata for nothing.
            self._planner = Planner(cache, self.groups, engine_blocks=bool(settings.events_pod_id),
                                    registration=self._registration)
            # What the engine loaded, reported to the server: its delivered-hit counters (tiercache.connector.delivery).
            self._delivery = DeliveryReporter(lookups, self.spec.namespace)
            _SCHEDULERS.add(self)
        else:
            # Made off the compute cores: gRPC's threads, born with the process's first channel, would otherwise
            # take their CPU time from the forward pass (cores.py).
            self.client = born_off_compute_cores(
                lambda: Client(settings.connection, timeout_s=settings.timeout_s, breaker=breaker))
            self._delivery = DeliveryReporter(self.client, self.spec.namespace)
            rank_namespaces = namespaces(self.spec)  # this rank's, per salt: loads and saves name the same
            self._loads = Loads(self.client, rank_namespaces, settings.max_pending_save_bytes, self.worker_stats)
            self._saves = Saves(self.client, rank_namespaces, settings.max_pending_save_bytes, self.worker_stats,
                                engine_blocks=tp_rank == 0, batch_s=settings.save_batch_s,
                                on_dropped=self._delivery.add)
        log.info("TierCacheConnector (%s) on %s: namespace %s, N=%d, u=%d", role.name, settings.connection.url,
                 self.spec.namespace, block, unit)
        vllm_unit = vllm_config.cache_config.prefix_match_unit
        if role == KVConnectorRole.SCHEDULER and self.groups.mamba and (vllm_unit or block) >= block:
            log.warning("TierCacheConnector: vLLM hashes prompts every %d tokens, its block size N: it keeps no "
                        "recurrent state below a block, so prompts shorter than N=%d get no hit and hits end on "
                        "block boundaries. Start vLLM with --prefix-match-unit 16.", vllm_unit or block, block)

    def _pod_registration(self, pod_id: str, model_name, namespaces: list[str], dp_rank: int) -> PodRegistration:
        """This engine's registration for KV events: its rank namespaces, its layout and vLLM's group index of each
        layout group (Mamba groups share the recurrent one: the first names it). Made at the start and again
        whenever a lookup finds that the server lost it (tiercache.connector.pod_registration); a failure is a
        warning: the engine serves without events."""
        groups = [*self.groups.attention, *self.groups.mamba[:1]]
        name = model_name[0] if isinstance(model_name, (list, tuple)) else str(model_name)

        def register(ports: tuple[int, int] | None) -> PodEndpoints:
            # One try: a server that is down costs the engine's start no more than a refused connection.
            with Client(self.settings.connection, timeout_s=10.0, retry=RetryPolicy(attempts=1)) as client:
                return client.register_pod(pod_id, name, namespaces, self.spec.shape, groups, dp_rank=dp_rank,
                                           match_unit=self.spec.match_unit, ports=ports)

        return PodRegistration(pod_id, register)

    @property
    def pod_registration(self) -> PodRegistration | None:
        """The scheduler's registration for KV events (None without `events_pod_id`, and in a worker)."""
        return self._registration

    @property
    def planner(self) -> Planner | None:
        """The scheduler half (None in a worker)."""
        return self._planner

    @property
    def loads(self) -> Loads | None:
        """The worker's loads (None in the scheduler)."""
        return self._loads

    @property
    def saves(self) -> Saves | None:
        """The worker's saves (None in the scheduler)."""
        return self._saves

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never a wrong answer

    # -- scheduler side ------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._planner.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return TierCacheMetadata(self._planner.plan_step(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        finished = set(connector_output.finished_recving or ())
        if finished or failed:
            self._delivery.add(self._planner.loads_reported(finished, failed))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._planner.finished(request, block_ids), None

    # -- worker side ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        pools = PoolSets(paged_views(self.groups, self._kv_cache_config, kv_caches))
        # The fetching, gathering and putting threads run off the cores vLLM's CPU backend computes on (cores.py).
        elsewhere = off_compute_cores()
        self._loads.register(pools, elsewhere)
        self._saves.register(pools, elsewhere)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """vLLM calls this first thing in every step, before it writes a block: the last step's saves must have been
        copied out by now (on CPU they are copied beside the engine, between steps)."""
        self._saves.before_step()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._loads.start(self._get_connector_metadata().plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous and finish before vLLM schedules the request."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing per layer: wait_for_save gathers every layer of a chunk in one kernel launch."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._saves.save(self._get_connector_metadata().plan.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        idle = self.has_connector_metadata() and self._get_connector_metadata().plan.idle
        loads = self._loads.ended(idle=idle)
        return KVConnectorTransferResults(finished_sending=self._saves.finished(), finished_recving=loads.ended,
                                          failed_recving=loads.failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Always empty: a failed load is reported for its whole request (failed_recving), which vLLM 0.33 requires
        for hybrid layouts (block ids are per group there) and treats alike for one group: recompute the request."""
        return set()

    def get_kv_connector_stats(self) -> TierCacheStats | None:
        """What changed since the last report (the counters themselves stay cumulative, for logs and tests), at most
        every STATS_INTERVAL_S: vLLM asks every step, and a worker's report travels to the engine core with the step's
        output (pickled, every step), while vLLM only logs the sums every few seconds."""
        now = time.monotonic()
        if now - self._reported_at < STATS_INTERVAL_S:
            return None
        self._reported_at = now
        source = self._planner.stats if self._planner is not None else self.worker_stats
        totals = vars(source).copy()  # (plain int counters: no deep copy each step)
        changed = {name: value - self._reported.get(name, 0) for name, value in totals.items()}
        self._reported = totals
        stats = TierCacheStats(data=changed)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierCacheStats:
        return TierCacheStats(data=dict(data or {}))

    def drain(self, timeout_s: float | None = None) -> bool:
        """A worker: wait for every gather and put, then every started load (shutdown, tests); False when
        `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self._saves.drain(deadline) and self._loads.drain(deadline)

    def shutdown(self) -> None:
        if self._saves is not None and self._saves.registered:
            for scheduler in list(_SCHEDULERS):  # in-process engine core: saves no later step will deliver
                if scheduler._vllm_config is self._vllm_config:
                    self._saves.save(scheduler._planner.take_finishes(), inline=True)
            # Finish the saves already gathered, bounded: a hung server must not hang vLLM's exit.
            if not self.drain(FLUSH_TIMEOUT_S):
                log.warning("tiercache: saves still pending after %.0f s at shutdown are dropped", FLUSH_TIMEOUT_S)
            self._saves.stop()
            self._loads.stop()
        self._delivery.close()
        if self._registration is not None:
            self._registration.close()
        if self._planner is not None:
            self._planner.cache.client.close()
        if self.client is not None:
            self.client.close()


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's process groups are not set up: one rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0
