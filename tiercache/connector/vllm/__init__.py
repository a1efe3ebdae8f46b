"""tiercache as a vLLM KV connector: `kv_connector_module_path: tiercache.connector.vllm` (see `connector`).

`connector` (vLLM's entry point), `plan` (scheduler half), `transfer` (worker half), `layout` (vLLM's buffers as
tiercache objects), `identity` (what names the model's weights). Only `connector` imports vLLM when loaded:
the connector class is resolved on first access, so the other modules load without vLLM.
"""


def __getattr__(name: str):
    if name in ("VllmSettings", "TierCacheConnector"):
        from tiercache.connector.vllm import connector
        return getattr(connector, name)
    raise AttributeError(name)


__all__ = ["VllmSettings", "TierCacheConnector"]
