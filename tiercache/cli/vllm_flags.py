"""vLLM's command-line flags, read as `vllm serve` reads them but without vLLM: the ones `tiercache layout` and
`tiercache check-vllm` weigh (tiercache.cli.vllm) and the parser `tiercache vllm-tier` adds its own to
(tiercache.cli.vllm_tier). `--a_b` and `--a-b` are one flag, as in vLLM; a flag's JSON value is checked to be an
object; an error is one line."""

from __future__ import annotations

import argparse
import json

from tiercache.cli.values import non_negative, positive
from tiercache.errors import InvalidArgument


class VllmFlags(argparse.ArgumentParser):
    """vLLM's flags that decide what the connector refuses and what N is; others are reported as not checked. An
    error is one line (main prints `tiercache check-vllm: error: ...`)."""

    def error(self, message: str) -> None:
        raise InvalidArgument(f"vLLM flags: {message}")


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's own flags that change N or the bytes, under vLLM's names and defaults."""
    from tiercache.prefix.block_size import KV_CACHE_DTYPES, MODEL_DTYPES, STATE_DTYPES

    parser.add_argument("--tensor-parallel-size", "-tp", type=positive, default=1, metavar="TP",
                        help="vLLM's tensor-parallel size: sizes are one rank's (default 1)")
    parser.add_argument("--dtype", default="auto", choices=MODEL_DTYPES, help="vLLM's --dtype (default auto)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="vLLM's --kv-cache-dtype (default auto: the model's dtype)")
    parser.add_argument("--mamba-cache-dtype", default="auto", choices=STATE_DTYPES,
                        help="vLLM's --mamba-cache-dtype, the conv state's (default auto: the model's dtype)")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=STATE_DTYPES,
                        help="vLLM's --mamba-ssm-cache-dtype, the recurrent state's (default auto: the model's rule)")
    parser.add_argument("--block-size", type=positive, metavar="B", help="vLLM's --block-size (default: the "
                        "platform's)")


def parse_vllm_flags(tokens: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """vLLM's flags as vLLM reads them (underscores or dashes); the ones with no bearing here, for the report."""
    parser = VllmFlags(prog="vllm serve", add_help=False, allow_abbrev=False)
    add_cache_flags(parser)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction)
    for name in ("--kv-transfer-config", "--speculative-config"):
        parser.add_argument(name)
    parser.add_argument("--prefix-match-unit", type=positive)
    parser.add_argument("--prefix-cache-retention-interval", type=non_negative)
    # Read so they are not reported unchecked: the connector hashes tokens itself (prefix.hashes), and prefix
    # caching alone decides the Mamba cache mode in vLLM 0.32 and 0.33 (preflight.mamba_mode_refusal).
    for name in ("--prefix-caching-hash-algo", "--mamba-cache-mode"):
        parser.add_argument(name)
    flags, rest = parser.parse_known_args(normalized_flags(tokens))
    return flags, [t for t in rest if t.startswith("-")]


def normalized_flags(tokens: list[str]) -> list[str]:
    """vLLM's flags as vLLM reads them: `--a_b` and `--a-b` (with or without `=value`) are one flag."""
    return [t.split("=", 1)[0].replace("_", "-") + t[len(t.split("=", 1)[0]):] if t.startswith("--") else t
            for t in tokens]


def json_flag(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{flag} must be a JSON object, got {text!r}")
    return value
