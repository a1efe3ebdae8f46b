"""The Python client: what an engine process imports. It loads no store, tier, server, auth or metrics module.

`client` (Client: the API, every call through one `_call`), `settings` (ConnectionSettings: URL, token, TLS; the one
reader of the environment), `payload` (what a payload path is), its three paths `arena_path` (over `shared_arena`, the
mapping of the server's arena), `data_channel` and `streams`, `chooser` (which path carries a call: Attach and
fallbacks), `transport` (the gRPC channel, one RPC try), `retry` (RetryPolicy), `breaker` (fail fast while the server
is unreachable), `probe` (is a server there at all: the CLI's commands ask before they start)."""

from tiercache.backoff import Backoff
from tiercache.client.breaker import BreakerPolicy
from tiercache.client.client import Client, LookupAnswer
from tiercache.client.payload import Chunk, Fetched
from tiercache.client.retry import RetryPolicy
from tiercache.client.settings import DEFAULT_URL, ConnectionSettings
from tiercache.errors import TierCacheError
from tiercache.record.encoding import ChunkMeta

__all__ = ["DEFAULT_URL", "Backoff", "BreakerPolicy", "Chunk", "ChunkMeta", "Client", "ConnectionSettings", "Fetched",
           "LookupAnswer", "RetryPolicy", "TierCacheError"]
