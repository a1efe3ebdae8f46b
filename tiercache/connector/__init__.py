"""Engine connectors: the engine-neutral PrefixCache (`prefix_cache`), and one package per engine (`hf`, `vllm`).

The top of the client side: imports `client`, `prefix`, `kernels`, `record`, `config`, `errors`."""

from tiercache.connector.prefix_cache import Lookup, PrefixCache, SaveResult

__all__ = ["Lookup", "PrefixCache", "SaveResult"]
