"""The Python client: what an engine process imports. It loads no store, tier, server, auth or metrics module.

`client` (Client, every call through one `_call`), `retry` (RetryPolicy), `breaker` (fail fast while the server
is unreachable), `transport` (channel, TLS, tokens), `shared_arena` (the same-host path's mapping of the server's
arena), `probe` (is a server there at all: the CLI's commands ask before they start)."""

from tiercache.client.breaker import BreakerPolicy
from tiercache.client.client import Chunk, Client, Fetched, LookupAnswer
from tiercache.client.retry import RetryPolicy
from tiercache.client.transport import Security
from tiercache.errors import TierCacheError
from tiercache.record.encoding import ChunkMeta

__all__ = ["BreakerPolicy", "Chunk", "ChunkMeta", "Client", "Fetched", "LookupAnswer", "RetryPolicy", "Security",
           "TierCacheError"]
