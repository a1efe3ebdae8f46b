"""What both roles of the vLLM connector read from vLLM's configs alike, before either makes its own side: the
settings (`kv_connector_extra_config`), vLLM's KV cache groups, this rank's layout (its namespace's fingerprint,
identity included) and the cache spec (N, u, salt). A configuration the connector cannot serve is refused here,
first thing (preflight).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.connector.vllm.identity import engine_identity
from tiercache.connector.vllm.layout import EngineGroups, engine_groups, model_layout
from tiercache.connector.vllm.preflight import choices_of, refuse
from tiercache.connector.vllm.settings import VllmSettings
from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.objects import CacheSpec


@dataclass(frozen=True)
class EngineSetup:
    settings: VllmSettings
    groups: EngineGroups
    layout: ModelLayout  # this rank's
    spec: CacheSpec


def engine_setup(vllm_config, kv_cache_config, worker: bool) -> EngineSetup:
    """The setup of one connector: a worker's for its tensor-parallel rank, the scheduler's for rank 0."""
    if kv_cache_config is None:
        raise InvalidArgument("TierCacheConnector needs vLLM's KVCacheConfig, which vLLM 0.32 and 0.33 pass to "
                              "connectors (an older vLLM does not)")
    # What vLLM let us refuse before its engine core started (preflight.refuse_early), said again here for the
    # starts where vLLM resolved the connector's class no earlier.
    refuse(choices_of(vllm_config))
    settings = VllmSettings.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    groups = engine_groups(kv_cache_config)
    model = vllm_config.model_config
    # Each worker loads and saves its own rank's shard; the scheduler's lookup asks for every rank's shards, so
    # a hit is one every rank can load (a shard gone between lookup and load fails that rank's load, and vLLM
    # recomputes the request: never a mix of prefixes).
    tp_rank = tensor_parallel_rank() if worker else 0
    layout = model_layout(groups, kv_cache_config, settings.model_name or model.served_model_name or model.model,
                          settings.revision or model.revision or "main", tp_rank=tp_rank,
                          tp_size=vllm_config.parallel_config.tensor_parallel_size,
                          identity=engine_identity(vllm_config, groups, settings.weights_id, kv_cache_config))
    block = groups.block_size
    unit = settings.match_unit or (16 if block % 16 == 0 else block)
    spec = CacheSpec(layout, block, unit, salt=settings.salt, max_boundary_states=settings.max_boundary_states)
    return EngineSetup(settings, groups, layout, spec)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's process groups are not set up: one rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return 0
