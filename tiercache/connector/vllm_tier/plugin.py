"""The `vllm.general_plugins` entry point: registers the short tier type "tiercache" with vLLM's tier factory in every
vLLM process (the API server resolves tier classes too, for metrics). It never raises: a plugin that raised would
stop vLLM from starting even where no tier is configured (a vLLM without tiering, a second registration)."""

from __future__ import annotations

import logging

from tiercache.connector.vllm_tier.settings import MODULE_PATH, SHORT_NAME, TIER_CLASS

log = logging.getLogger(__name__)


def register() -> None:
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except Exception:  # noqa: BLE001 - a vLLM without tiering: nothing to register
        return
    try:
        if SHORT_NAME not in getattr(SecondaryTierFactory, "_registry", {}):
            SecondaryTierFactory.register_tier(SHORT_NAME, MODULE_PATH, TIER_CLASS)
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        log.warning("tiercache: could not register the %r secondary tier with vLLM: %s", SHORT_NAME, exc)
