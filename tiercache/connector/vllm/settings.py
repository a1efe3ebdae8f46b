"""The vLLM connector's settings: `kv_connector_extra_config`, read once (no vLLM import, so `tiercache check-vllm`
reads them as the connector will). The connection's keys are tiercache.client.settings'; the rest are the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tiercache.client.settings import ConnectionSettings
from tiercache.config import refuse_unknown
from tiercache.errors import InvalidArgument


@dataclass(frozen=True)
class VllmSettings:
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)  # url, token, TLS files
    model_name: str | None = None
    revision: str | None = None
    match_unit: int | None = None
    salt: str = ""
    weights_id: str | None = None  # names the weights outright (else: read from the model's files)
    timeout_s: float = 30.0  # loads and saves (worker threads; the engine never waits on them)
    lookup_timeout_s: float = 0.5  # the scheduler's one lookup call per request: vLLM's scheduler thread waits on it
    # While the server is unreachable, lookups, loads and saves fail at once (a miss, a recompute, a skipped save)
    # and a health check probes it in the background, at most this far apart (tiercache.client.breaker).
    offline_backoff_s: float = 2.0
    max_pending_save_bytes: int = 1 << 30
    save_batch_s: float = 0.05  # saves wait this long to be sent together (tiercache.connector.vllm.put_queue)
    max_boundary_states: int = 0  # block-boundary states saved per prompt, the deepest first; 0: every one offered
    # KV events for routers (docs/events.md): the scheduler registers the engine under this pod id with a server
    # started with --events (the topic is kv@<pod id>@<the served model name>); unset: no registration.
    events_pod_id: str | None = None

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "VllmSettings":
        ours = [f.name for f in fields(cls) if f.name != "connection"]
        refuse_unknown(extra or {}, [*ConnectionSettings.keys(), *ours],
                       "unknown kv_connector_extra_config keys for TierCacheConnector:", InvalidArgument)
        connection, engine = ConnectionSettings.from_config(extra or {})
        return cls(connection, **engine)

