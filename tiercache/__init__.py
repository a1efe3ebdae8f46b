"""tiercache: a tiered cache service for LLM inference (KV chunks and recurrent-state checkpoints)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import tiercache` stays cheap and does not need the generated stubs until a client is made.
    if name == "Client":
        from tiercache.client import Client
        return Client
    raise AttributeError(name)


__all__ = ["Client", "__version__"]
