"""What names a vLLM engine's bytes beyond their shapes: the weights, quantization, dtypes, the order of layers in
an object, and the engine's page layout. It goes into the namespace (`ModelLayout.identity`), so two checkpoints
served from the same path or name, or a CPU and a GPU engine (their attention pages differ), never share bytes.
Within vLLM's CPU build the page layout follows the host's CPU (`page_layout`): its attention kernel arranges K/V
for AMX tiles on a CPU with AMX and otherwise not, with pages of the same size, so CPU engines on hosts of two kinds
sharing one server would read each other's pages wrongly ordered, checksums intact (prefix.cpu_features). The
runtime's part (the model, dtype, vLLM's version, the platform, the attention backend: `runtime_identity`) opens the
secondary tier's namespace too (connector.vllm_tier.namespace), written by this one function for both.

The weights' identity is read from the files, not from the name: a file in a Hugging Face cache snapshot is a link
to a blob named by its content hash (that name is used as it is); any other weight file is hashed (xxh3-128) once
and remembered by (path, size, mtime, inode) in `$XDG_CACHE_HOME/tiercache/weights.json`, so later starts cost a
stat per file. `kv_connector_extra_config.weights_id` sets it outright (e.g. an artifact digest), skipping the files.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

import xxhash

from tiercache.config import cache_dir

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json", "quant_config.json", "hf_quant_config.json")
_BLOCK_BYTES = 8 << 20


def weights_identity(model_dir: Path, memo_path: Path | None = None) -> str:
    """A 32-hex digest of the model directory's weight and config files (see the module docstring)."""
    memo_path = memo_path or _memo_path()
    memo = _load_memo(memo_path)
    digest = xxhash.xxh3_128()
    changed = False
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or not (path.suffix in WEIGHT_SUFFIXES or path.name in CONFIG_FILES):
            continue
        file_id, fresh = _file_identity(path, memo)
        changed |= fresh
        digest.update(f"{path.name}={file_id};".encode())
    if changed:
        _save_memo(memo_path, memo)
    return digest.hexdigest()


def _file_identity(path: Path, memo: dict) -> tuple[str, bool]:
    """(identity, whether it was computed now). A hub blob's name is its content hash already."""
    target = path.resolve()
    if target != path.absolute() and target.parent.name == "blobs":
        return f"blob:{target.name}", False
    stat = target.stat()
    key = f"{target}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    if key in memo:
        return memo[key], False
    digest = xxhash.xxh3_128()
    with open(target, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            digest.update(block)
    memo[key] = digest.hexdigest()
    return memo[key], True


def _memo_path() -> Path:
    return cache_dir() / "weights.json"


def _load_memo(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_memo(path: Path, memo: dict) -> None:
    """Atomic replace: concurrent engine processes may write it at once; either version is right."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(memo, f)
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("tiercache: cannot remember weight hashes in %s: %s", path, exc)


def model_directory(model: str, revision: str | None) -> Path | None:
    """The local directory of `model`: the path itself, or its snapshot in the Hugging Face cache (no download)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a hub id, no huggingface_hub: the caller decides what to do
        return None


def model_identity(weights_id: str, quantization: str | None, cache_dtype: str, hf_overrides) -> str:
    """What of `vllm serve`'s model and flags changes the bytes and that vLLM hands neither of tiercache's vLLM parts
    in plain sight: the weights, the quantization, the KV cache's dtype (fp8 variants have one size), and the config
    overrides (`--hf-overrides`: a RoPE scaling changes every K). The connector reads them from vLLM's config; the
    secondary tier, which vLLM gives no config, takes this text from `tiercache vllm-tier`, which reads the same
    flags (tests/vllm/test_identity.py holds both to one answer)."""
    return ";".join([f"weights={weights_id}", f"quant={quantization}", f"cache={cache_dtype}",
                     f"overrides={overrides_digest(hf_overrides)}"])


def overrides_digest(hf_overrides) -> str:
    """A digest of vLLM's hf_overrides: a dict (what --hf-overrides parses to), a function (the Python API's: named
    by its qualified name, the most that can be said of it), or nothing."""
    if not hf_overrides:
        return "none"
    if callable(hf_overrides):
        return f"fn:{getattr(hf_overrides, '__module__', '?')}.{getattr(hf_overrides, '__qualname__', '?')}"
    text = json.dumps(hf_overrides, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def runtime_identity(model_identity: str, dtype, attention, *, platform_key: str,
                     cpu_device: Callable[[], str]) -> list[str]:
    """What both of tiercache's vLLM parts name first, in this order: the model and the flags that change its bytes
    (`model_identity`), the model's dtype, vLLM's version, the platform and its device, the attention backend. The
    connector's namespace (engine_identity) and the secondary tier's (vllm_tier.namespace) each go on with what
    decides the bytes of their own objects.

    Each part names two of these its own way, kept as they were when it first stored chunks (another text is
    another namespace: every chunk stored before would be a miss): the platform under `platform_key` ("device",
    "platform"), and a CPU by `cpu_device()`: the connector's "cpu" (its page_layout names the CPU's attention
    kernel), the tier's cpu_capabilities (vLLM tells a tier no kernel). `attention` is written as each part is given
    it: vLLM's attention config (None when unset), or the tier's flag ("auto" when unset)."""
    import vllm
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    device = cpu_device() if kind == "cpu" else device_name(current_platform)
    return [model_identity, f"dtype={dtype}", f"vllm={vllm.__version__}", f"{platform_key}={kind}:{device}",
            f"attention={attention}"]


def engine_identity(vllm_config, groups, weights_id: str | None = None, kv_cache_config=None) -> str:
    """Canonical text of everything besides shapes that decides an object's bytes in this engine: the runtime
    (runtime_identity), the order of layers in each group, and the page layout."""
    model = vllm_config.model_config
    attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layers = "|".join(",".join(names) for names in groups.layer_names)
    runtime = runtime_identity(engine_model_identity(vllm_config, weights_id), model.dtype, attention,
                               platform_key="device", cpu_device=lambda: "cpu")
    return ";".join([*runtime, f"layers={layers}", *filter(None, [page_layout(vllm_config, kv_cache_config, groups)])])


def engine_model_identity(vllm_config, weights_id: str | None = None) -> str:
    """model_identity read from a running engine's config (`weights_id` names the weights outright)."""
    model = vllm_config.model_config
    if weights_id is None:
        directory = model_directory(model.model, model.revision)
        if directory is None:
            log.warning("tiercache: cannot read the weights of %s; the namespace names them by name and revision "
                        "only (set weights_id to name them exactly)", model.model)
            weights_id = "unread"
        else:
            weights_id = weights_identity(directory)
    return model_identity(weights_id, model.quantization, vllm_config.cache_config.cache_dtype,
                          getattr(model, "hf_overrides", None))


def page_layout(vllm_config, kv_cache_config, groups) -> str:
    """How the engine arranges the bytes inside its pages where the platform or the host decides it: on the CPU, the
    attention kernel of each attention group (vLLM CPU's `_get_attn_isa`: "amx", "vec", "vec16", ...); for a hybrid,
    the conv state's layout ("SD" or "DS": VLLM_SSM_CONV_STATE_LAYOUT, which vLLM sets for NIXL). "" where neither
    applies (a dense model on a GPU: its namespace is what it was before the CPU kernels were named)."""
    from vllm.platforms import current_platform

    parts = []
    if current_platform.device_type == "cpu" and kv_cache_config is not None:
        parts.append(f"cpu_attention={_cpu_attention_kernels(vllm_config, kv_cache_config, groups)}")
    if groups.mamba:
        try:
            from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
            conv = get_conv_state_layout()
        except ImportError:  # a vLLM without the choice: its one layout
            conv = "fixed"
        parts.append(f"conv={conv}")
    return ";".join(parts)


def _cpu_attention_kernels(vllm_config, kv_cache_config, groups) -> str:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    specs = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in groups.attention]
    try:  # a private function of vLLM's CPU backend
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return ",".join(_get_attn_isa(model.dtype, spec.block_size, spec.head_size, cache.cache_dtype)
                        for spec in specs)
    except Exception as exc:  # noqa: BLE001 - a vLLM without it: name what decides the kernel instead
        log.warning("TierCacheConnector: vLLM does not say which CPU attention kernel lays out this engine's pages "
                    "(%s); the namespace names the CPU's capabilities instead", exc)
        return cpu_capabilities()


def cpu_capabilities() -> str:
    """What vLLM's CPU kernels choose by (an engine whose kernel cannot be named shares only with one of the same
    CPU); this host's name where even that cannot be read."""
    import socket

    import torch

    try:
        return "caps:" + ",".join(name for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported",
                                                    "_is_avx512_supported") if getattr(torch.cpu, name)())
    except Exception:  # noqa: BLE001 - no sharing beyond this host
        return f"host:{socket.gethostname()}"


def device_name(platform) -> str:
    try:
        return platform.get_device_name(0) if platform.device_type != "cpu" else "cpu"
    except Exception:
        return "unknown"
