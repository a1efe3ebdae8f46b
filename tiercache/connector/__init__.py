"""Engine connectors: the engine-neutral PrefixCache, and adapters for specific engines (hf, later vllm)."""

from tiercache.connector.prefix_cache import Lookup, PrefixCache, SaveResult

__all__ = ["Lookup", "PrefixCache", "SaveResult"]
