"""tiercache as a secondary tier behind vLLM's own KV offloading (vLLM 0.32 and 0.33): in vLLM's
`kv_connector_extra_config`, `"spec_name": "TieringOffloadingSpec"` and a `secondary_tiers` entry
`{"type": "TierCacheTier", "module_path": "tiercache.connector.vllm_tier", "url": ..., "model_identity": ...}`
(`tiercache vllm-tier` prints it), or `"type": "tiercache"` once the package's vLLM plugin registered the name.

`tier` (vLLM's SecondaryTierManager), `verdicts` (lookups that never wait), `transfers` (store and load jobs),
`namespace` (what the keys and slots mean), `settings` (the entry's keys), `plugin` (the short name). Only `tier`
imports vLLM, when the class is first asked for: the package loads without vLLM.
"""


def __getattr__(name: str):
    if name == "TierCacheTier":
        from tiercache.connector.vllm_tier.tier import TierCacheTier

        return TierCacheTier
    raise AttributeError(name)


__all__ = ["TierCacheTier"]
