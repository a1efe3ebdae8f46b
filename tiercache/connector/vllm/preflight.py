"""What the vLLM connector refuses in an engine's configuration, said before vLLM starts its engine core.

vLLM (0.32, 0.33) constructs a KV connector only after the engine core has loaded the model and sized its KV cache:
the scheduler's `KVConnectorFactory.create_connector` and the worker's `ensure_kv_transfer_initialized` both take the
KVCacheConfig. A refusal raised there came ~90 s into a start on the CI machine, inside the engine core's traceback,
under vLLM's own "Engine core initialization failed". No connector hook sees the configuration earlier: while vLLM
validates a VllmConfig it calls `requires_piecewise_for_cudagraph` (the extra config only, with full CUDA graphs
only), `supports_sleep_mode` (0.33, with sleep mode only) and `supports_hma` (an `issubclass`). Each of them first
resolves the class by name from this package, though, inside `VllmConfig.__post_init__` in the process that builds the
config (the API server, or `LLM`), and after the model's config hooks have run (prefix caching has decided the Mamba
cache mode by then). `refuse_early` finds that config on the stack and checks it, so the refusal is raised out of
`VllmConfig(...)` before any engine process exists: one traceback in the front process, whose last line is ours
(tests/vllm_engine/test_early_refusals.py). The constructor makes the same checks with the same words
(`refuse(choices_of(config))`), for the starts that resolve the class no earlier: with
`--[no-]disable-hybrid-kv-cache-manager` given, vLLM skips the `supports_hma` question.

`tiercache check-vllm` makes the same checks from vLLM's command-line flags, without vLLM (tiercache.cli.vllm).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from tiercache.connector.vllm.settings import VllmSettings
from tiercache.errors import InvalidArgument


SPECULATIVE_REFUSAL = "TierCacheConnector does not support speculative decoding on Mamba groups yet"


@dataclass(frozen=True)
class EngineChoices:
    """What the checks read of an engine's configuration: a VllmConfig's values, or the flags that decide them."""

    vllm_version: str
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    hybrid: bool = False  # attention and Mamba / Gated DeltaNet layers
    attention_free: bool = False  # Mamba layers only
    mla: bool = False  # Multi-head Latent Attention (DeepSeek's)
    mamba_cache_mode: str = "align"  # as vLLM leaves it: 'align' with prefix caching, else 'none'
    mamba_speculative_blocks: int = 0  # vLLM's MambaSpec.num_speculative_blocks: speculative tokens, unless ReplaySSM


def refusals(choices: EngineChoices) -> list[str]:
    """Every refusal, one line each, in the connector's words (empty: the connector starts)."""
    found = []
    try:
        VllmSettings.from_extra_config(dict(choices.extra_config))
    except InvalidArgument as exc:
        found.append(str(exc))
    if choices.attention_free:
        found.append("TierCacheConnector needs attention layers; this model has none (Mamba layers only)")
    if choices.mla:
        found.append("TierCacheConnector supports plain K/V attention pages, not MLA (Multi-head Latent Attention)")
    if choices.hybrid and choices.mamba_cache_mode != "align":
        found.append(mamba_mode_refusal(choices.mamba_cache_mode, choices.vllm_version))
    if choices.hybrid and choices.mamba_speculative_blocks:
        found.append(SPECULATIVE_REFUSAL)
    return found


def refuse(choices: EngineChoices) -> None:
    """Raise the first refusal (vLLM prints one exception)."""
    found = refusals(choices)
    if found:
        raise InvalidArgument(found[0])


def choices_of(vllm_config) -> EngineChoices:
    """A VllmConfig's choices, once its model hooks have run (`__post_init__` past `try_verify_and_update_config`)."""
    vllm = sys.modules.get("vllm")  # loaded: it made the config
    model, cache = vllm_config.model_config, vllm_config.cache_config
    transfer = vllm_config.kv_transfer_config
    speculative = 0 if getattr(cache, "use_replayssm", False) else getattr(vllm_config, "num_speculative_tokens", 0)
    return EngineChoices(
        vllm_version=getattr(vllm, "__version__", "unknown"),
        extra_config=(transfer.kv_connector_extra_config if transfer is not None else None) or {},
        hybrid=bool(model is not None and model.is_hybrid),
        attention_free=bool(model is not None and model.is_attention_free),
        mla=bool(model is not None and model.use_mla),
        mamba_cache_mode=cache.mamba_cache_mode, mamba_speculative_blocks=speculative or 0)


def refuse_early() -> None:
    """Check the VllmConfig being validated up the stack, if there is one (module docstring); nothing otherwise."""
    config = _config_being_validated()
    if config is not None:
        refuse(choices_of(config))


def _config_being_validated():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__post_init__":
            candidate = frame.f_locals.get("self")
            if type(candidate).__name__ == "VllmConfig" and type(candidate).__module__.startswith("vllm."):
                return candidate
        frame = frame.f_back
    return None


def mamba_mode_refusal(mode: str, vllm_version: str) -> str:
    """What to tell a user whose engine runs its Mamba groups in another mode than 'align', for the vLLM running.

    Both vLLM 0.32 and 0.33 set the mode from prefix caching (MambaModelConfig.verify_and_update_config: 'align' when
    it is on, 'none' when off, whatever was passed). 0.32 still takes --mamba-cache-mode but overrides it; 0.33
    deprecates it ("has no effect: Mamba prefix caching follows --enable-prefix-caching", engine/arg_utils.py). So
    the remedy is --enable-prefix-caching (on by default for hybrid models: someone turned it off)."""
    head = (f"TierCacheConnector needs vLLM's Mamba cache mode 'align', got {mode!r} (no state kept per block): start "
            f"vLLM with --enable-prefix-caching")
    if minor_version(vllm_version) >= (0, 33):
        return (f"{head} (vLLM {vllm_version} derives the mode from it; --mamba-cache-mode is deprecated and has no "
                f"effect)")
    return (f"{head} (vLLM {vllm_version} derives the mode from it: --mamba-cache-mode align without prefix caching is "
            f"turned back to 'none')")


def minor_version(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)
