"""tiercache as a vLLM KV connector: `kv_connector_module_path: tiercache.connector.vllm` (see `connector`).

`connector` (vLLM's entry point) over `scheduler_side` (lookups; `plan`: what is loaded and saved) and `worker_side`
(`loads` and `saves`, through `staging` and `put_queue`), `engine_setup` (what both sides build alike), `layout`
(vLLM's buffers as tiercache objects), `identity` (what names the bytes: weights, runtime, page layout), `settings`
(kv_connector_extra_config), `preflight` (the refusals said before the engine core starts; vLLM's N before a start is
tiercache.prefix.block_size).
Only `connector` imports vLLM when loaded: the connector class is resolved on each access, so the other modules load
without vLLM.
"""


def __getattr__(name: str):
    if name == "TierCacheConnector":
        # vLLM resolves the class by name, the first time while it validates the engine's config: the moment to
        # refuse a configuration the connector cannot serve, before the engine core starts (preflight).
        from tiercache.connector.vllm.preflight import refuse_early

        refuse_early()
    if name == "TierCacheConnector":
        from tiercache.connector.vllm import connector
        return connector.TierCacheConnector
    if name == "VllmSettings":
        from tiercache.connector.vllm import settings
        return settings.VllmSettings
    raise AttributeError(name)


__all__ = ["VllmSettings", "TierCacheConnector"]
