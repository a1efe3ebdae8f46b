"""tiercache: a tiered cache service for LLM inference (KV chunks and recurrent-state checkpoints)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import tiercache` stays cheap and does not need the generated stubs until a client is made.
    if name == "Client":
        from tiercache.client.client import Client
        return Client
    if name == "tune_allocator":
        from tiercache.malloc import tune_allocator
        return tune_allocator
    raise AttributeError(name)


__all__ = ["Client", "__version__", "tune_allocator"]
