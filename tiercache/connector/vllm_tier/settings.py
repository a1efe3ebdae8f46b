"""The secondary tier's settings: the keys of its entry in vLLM's `secondary_tiers` list, read once (no vLLM import).
vLLM's tier factory passes every key of the entry but `type`, `module_path` and `backpressure` to the tier, so each
key here is one a user writes (or `tiercache vllm-tier` prints). The connection's keys are tiercache.client.settings'.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tiercache.client.settings import ConnectionSettings
from tiercache.config import refuse_unknown
from tiercache.errors import InvalidArgument

TIER_CLASS = "TierCacheTier"
MODULE_PATH = "tiercache.connector.vllm_tier"
SHORT_NAME = "tiercache"  # the name the `vllm.general_plugins` entry point registers (plugin.register)
# Keys vLLM's factory leaves in the entry and passes on (it reads `locality` itself but does not pop it).
VLLM_KEYS = ("locality",)


@dataclass(frozen=True)
class TierSettings:
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)  # url, token, TLS files
    # What of the model and vLLM's flags names the bytes beyond what vLLM tells a tier (its weights, quantization,
    # KV cache dtype, config overrides): `tiercache vllm-tier MODEL [flags]` prints it (identity.model_identity).
    model_identity: str = ""
    salt: str = ""  # a namespace of its own (e.g. per deployment), beside the tenant the token names
    # vLLM's --attention-backend where one is named (backends may lay K/V out differently in the same page size);
    # unnamed, vLLM picks by the platform and device, which the namespace names.
    attention_backend: str = ""
    # The scheduler never waits on the server: a lookup answers from what the tier knows, else RETRY while a
    # background thread asks; a key the server has not answered for after this long is a MISS.
    lookup_deadline_s: float = 0.5
    timeout_s: float = 30.0  # one store or load job's calls
    io_threads: int = 4  # store and load jobs run on these threads
    max_pending_store_bytes: int = 1 << 30  # stores queued beyond this are shed (failed at once, counted)
    offline_backoff_s: float = 2.0  # while the server is unreachable, health probes at most this far apart

    @classmethod
    def from_tier_kwargs(cls, kwargs: dict) -> "TierSettings":
        given = {k: v for k, v in kwargs.items() if k not in VLLM_KEYS}
        ours = [f.name for f in fields(cls) if f.name != "connection"]
        refuse_unknown(given, [*ConnectionSettings.keys(), *ours], f"unknown keys in the {TIER_CLASS} tier entry:",
                       InvalidArgument)
        connection, tier = ConnectionSettings.from_config(given)
        settings = cls(connection, **tier)
        if not settings.model_identity:
            raise InvalidArgument(
                f"{TIER_CLASS}: model_identity is missing: vLLM tells a secondary tier neither the weights nor "
                f"--hf-overrides, --quantization or --kv-cache-dtype, and bytes of another checkpoint or RoPE scaling "
                f"would load as hits. Run `tiercache vllm-tier --url URL MODEL [vllm serve's flags]` and use the "
                f"entry it prints")
        if settings.lookup_deadline_s <= 0 or settings.timeout_s <= 0 or settings.io_threads < 1:
            raise InvalidArgument(f"{TIER_CLASS}: lookup_deadline_s and timeout_s must be positive, io_threads at "
                                  f"least 1")
        return settings
