"""The vLLM connector in the scheduler's process: its lookups client, the startup check of the objects' size, the
Planner over a PrefixCache (plan), the pod registration for KV events, and the reporter of delivered hits.
"""

from __future__ import annotations

from tiercache.client import BreakerPolicy, Client, RetryPolicy
from tiercache.client.client import PodEndpoints
from tiercache.connector.delivery import DeliveryReporter
from tiercache.connector.limits import check_spec
from tiercache.connector.pod_registration import PodRegistration
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.connector.vllm.engine_setup import EngineSetup
from tiercache.connector.vllm.plan import Job, Planner, SchedulerStats


class SchedulerSide:
    def __init__(self, setup: EngineSetup, vllm_config) -> None:
        settings, spec = setup.settings, setup.spec
        model = vllm_config.model_config
        # One try within a short deadline: a lookup that cannot be answered quickly is a miss, not a stall, and the
        # breaker makes every later one an instant miss until the server answers again. The server counts the
        # lookup itself (no second call for statistics).
        self._lookups = Client(settings.connection, timeout_s=settings.lookup_timeout_s,
                               retry=RetryPolicy(attempts=1),
                               breaker=BreakerPolicy.probing_at_most(settings.offline_backoff_s))
        # Every rank's objects are the same size: the scheduler checks them once, before the engine serves.
        check_spec(self._lookups, spec, "TierCacheConnector")
        # With events, every lookup names the pod: its answer says whether the server still knows it.
        cache = PrefixCache(self._lookups, spec, all_ranks=True, pod_id=settings.events_pod_id or "")
        self.registration: PodRegistration | None = None
        if settings.events_pod_id:
            self.registration = pod_registration(setup, settings.events_pod_id,
                                                 model.served_model_name or model.model, cache.rank_namespaces(),
                                                 vllm_config.parallel_config.data_parallel_rank)
            self.registration.register()
        # Token ids and vLLM's hashes go with the kv saves only for an engine that has the server publish its KV
        # events: elsewhere they would cost the scheduler's step and the worker's metadata for nothing.
        self.planner = Planner(cache, setup.groups, engine_blocks=bool(settings.events_pod_id),
                               registration=self.registration)
        # What the engine loaded, reported to the server: its delivered-hit counters (tiercache.connector.delivery).
        self.delivery = DeliveryReporter(self._lookups, spec.namespace)

    @property
    def stats(self) -> SchedulerStats:
        return self.planner.stats

    def loads_reported(self, finished: set[str], failed: set[str]) -> None:
        """The workers reported these loads ended (vLLM's finished_recving and failed_recving): the planner counts
        them, and the server hears what was delivered."""
        if finished or failed:
            self.delivery.add(self.planner.loads_reported(finished, failed))

    def take_finishes(self) -> list[Job]:
        """End-of-request saves no step has handed to the workers yet (the worker's shutdown in this process)."""
        return self.planner.take_finishes()

    def close(self) -> None:
        self.delivery.close()
        if self.registration is not None:
            self.registration.close()
        self._lookups.close()


def pod_registration(setup: EngineSetup, pod_id: str, model_name, namespaces: list[str],
                     dp_rank: int) -> PodRegistration:
    """This engine's registration for KV events: its rank namespaces, its layout and vLLM's group index of each
    layout group (Mamba groups share the recurrent one: the first names it). Made at the start and again whenever a
    lookup finds that the server lost it (tiercache.connector.pod_registration); a failure is a warning: the engine
    serves without events."""
    groups = [*setup.groups.attention, *setup.groups.mamba[:1]]
    name = model_name[0] if isinstance(model_name, (list, tuple)) else str(model_name)
    spec = setup.spec

    def register(ports: tuple[int, int] | None) -> PodEndpoints:
        # One try: a server that is down costs the engine's start no more than a refused connection.
        with Client(setup.settings.connection, timeout_s=10.0, retry=RetryPolicy(attempts=1)) as client:
            return client.register_pod(pod_id, name, namespaces, spec.shape, groups, dp_rank=dp_rank,
                                       match_unit=spec.match_unit, ports=ports)

    return PodRegistration(pod_id, register)

