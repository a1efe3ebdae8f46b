"""tiercache as an SGLang HiCache storage backend (`--hicache-storage-backend dynamic` with
`"module_path": "tiercache.connector.sglang", "class_name": "TierCacheStorage"`; see `storage`).

`storage` (the backend SGLang creates; imports SGLang), `naming` (namespaces and keys for SGLang's pages). The
backend class is resolved on first access, so `naming` loads without SGLang.
"""


def __getattr__(name: str):
    if name in ("SGLangSettings", "TierCacheStorage"):
        from tiercache.connector.sglang import storage
        return getattr(storage, name)
    raise AttributeError(name)


__all__ = ["SGLangSettings", "TierCacheStorage"]
