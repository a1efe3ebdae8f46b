"""`tiercache vllm-tier`: the `secondary_tiers` entry that puts tiercache behind vLLM's own KV offloading, from the
model and the flags `vllm serve` gets.

vLLM tells a secondary tier the model's name, dtype and layout, but not what else changes the bytes: which weights
are at that path, `--quantization`, `--kv-cache-dtype` (fp8 variants are one size), `--hf-overrides` (a RoPE scaling
changes every K), `--attention-backend`. This command reads them as the engine will (the weights from their files,
as the connector does: connector.vllm.identity) and prints them in the entry (`model_identity`, which the tier
refuses to start without, and `attention_backend`).
Never imports vLLM.

Exit status: 0, the entry is printed (one JSON line); 2, bad input (one line).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

from tiercache.cli.vllm_flags import VllmFlags, json_flag, normalized_flags
from tiercache.errors import InvalidArgument


def add_command(commands: argparse._SubParsersAction, command: Callable[..., argparse.ArgumentParser]) -> None:
    parser = command(commands, "vllm-tier", help="print the secondary_tiers entry for tiercache behind vLLM's own "
                     "KV offloading", usage="tiercache vllm-tier [--url URL] [--salt S] MODEL [vllm serve's flags]",
                     description="Prints one JSON line: the entry of kv_connector_extra_config.secondary_tiers "
                                 "(TieringOffloadingSpec) that makes a tiercache server a secondary tier of vLLM's "
                                 "offloading, with the model_identity the tier needs (the weights, --quantization, "
                                 "--kv-cache-dtype and --hf-overrides, read as vLLM will). Pass the model and flags "
                                 "exactly as to `vllm serve`. Nothing is downloaded; vLLM is not needed.")
    parser.add_argument("--url", help="the tiercache server (default: $TIERCACHE_URL, else the default server); the "
                                      "token and TLS files come from the tier's environment, never from this entry")
    parser.add_argument("--salt", default="", help="a namespace of its own (as the connector's salt)")
    parser.add_argument("model", metavar="MODEL", help="the model's directory, or a model id already in the Hugging "
                                                       "Face cache")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="...", help="vllm serve's flags")


def vllm_tier(args: argparse.Namespace) -> int:
    print(json.dumps(tier_entry(args.model, args.vllm_args, args.url, args.salt)))
    return 0


def tier_entry(model: str, vllm_args: list[str], url: str | None = None, salt: str = "") -> dict:
    from tiercache.client.settings import ConnectionSettings
    from tiercache.connector.vllm.identity import model_directory, model_identity, weights_identity
    from tiercache.connector.vllm_tier.settings import MODULE_PATH, TIER_CLASS

    flags = _parse(vllm_args)
    directory = model_directory(model, flags.revision)
    if directory is None or not (directory / "config.json").is_file():
        raise InvalidArgument(f"no config.json for {model!r}: pass the model's directory (nothing is downloaded)")
    overrides = json_flag("--hf-overrides", flags.hf_overrides) or None
    entry = {"type": TIER_CLASS, "module_path": MODULE_PATH, "url": ConnectionSettings.from_env(url=url).url,
             "model_identity": model_identity(weights_identity(directory), flags.quantization, flags.kv_cache_dtype,
                                              overrides)}
    if salt:
        entry["salt"] = salt
    if flags.attention_backend:
        entry["attention_backend"] = flags.attention_backend
    return entry


def _parse(tokens: list[str]) -> argparse.Namespace:
    parser = VllmFlags(prog="vllm serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--revision")
    parser.add_argument("--quantization", "-q")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--hf-overrides")
    parser.add_argument("--attention-backend")
    flags, _ = parser.parse_known_args(normalized_flags(tokens))
    return flags

