"""vLLM's block size N and the bytes it caches, before the first start: from a model's config.json and the flags that
change them, without vLLM.

vLLM (0.32, 0.33) picks a hybrid model's block size once the model is built (`Platform._align_hybrid_block_size`,
vllm/platforms/interface.py): one attention page must hold one recurrent layer's state, so

    k = max(the attention backend's smallest kernel block, cache_config.block_size)
    N = k * ceil(state bytes per layer / (k * KV bytes per token per layer)), rounded up to the kernel block

and logs "Setting attention block size to N tokens". The kernel block and the default block size are the platform's
(`PLATFORMS`); the dtypes are the flags', resolved as vLLM resolves `auto` (`resolve_dtypes`), which on the CPU
platform depends on the CPU (prefix.cpu_features: the same model gets N = 256 on an AVX-512 BF16 server and 128 on an
AVX2 one, tests/prefix/test_block_size.py). N decides the flags a
deployment passes (`--prefix-cache-retention-interval N`) and every object's size, so `tiercache layout` prints it
before anything starts; tests/vllm_engine/test_block_size.py checks it against what vLLM's CPU engine logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tiercache.errors import InvalidArgument
from tiercache.prefix.cpu_features import CpuFeatures, detect
from tiercache.prefix.hf_config import HybridConfig, hybrid_layout, read_hybrid_config
from tiercache.prefix.layout import ModelLayout, unified_block_size


@dataclass(frozen=True)
class Platform:
    """What vLLM's block sizing reads of a platform and its attention backend."""

    name: str
    kernel_block: int  # the attention backend's smallest kernel block (`get_supported_kernel_block_sizes`)
    default_block: int  # cache_config.block_size without --block-size
    about: str


PLATFORMS = {
    # FlashAttention 2/3 (Ampere, Hopper): MultipleOf(16) kernel blocks; vLLM's default block size, 16, is one.
    "cuda": Platform("cuda", 16, 16, "GPU, FlashAttention 2/3: kernel blocks of 16 tokens"),
    # CpuPlatform.check_and_update_config sets 128 without --block-size; CPU attention takes MultipleOf(32).
    "cpu": Platform("cpu", 32, 128, "vLLM's CPU backend: blocks of 128 tokens (kernel blocks of 32)"),
}
DEFAULT_PLATFORM = "cuda"

# vLLM's dtype names (--dtype, --kv-cache-dtype, --mamba-*-cache-dtype) -> tiercache's (prefix.layout.DTYPE_BYTES).
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32",
           "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# --kv-cache-dtype values whose pages are plain K/V elements (the packed and per-token-scaled ones are not sized)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
STATE_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CacheFlags:
    """vLLM's flags that change N or the bytes (their vLLM defaults)."""

    tensor_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    block_size: int | None = None
    kernel_block_size: int | None = None  # another attention backend's smallest kernel block than the platform's


@dataclass(frozen=True)
class Dtypes:
    model: str
    kv: str
    conv: str
    ssm: str


@dataclass(frozen=True)
class EngineSizing:
    """One tensor-parallel rank of a vLLM engine: its layout, N, and what decided them."""

    layout: ModelLayout
    block_tokens: int  # N
    kernel_alignment: int  # k above
    platform: Platform
    dtypes: Dtypes
    cpu: CpuFeatures | None = None  # the CPU platform's: what decided the state's dtype

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.layout.attention_groups[0].kv_bytes_per_token_per_layer

    @property
    def state_bytes_per_layer(self) -> int:
        return self.layout.recurrent_group.state_bytes_per_layer

    @property
    def kv_chunk_bytes(self) -> int:
        """One `kv` object: N tokens of every attention layer (tiercache.prefix.objects)."""
        return self.block_tokens * self.layout.kv_bytes_per_token


def engine_sizing(config: Mapping[str, Any], model: str, flags: CacheFlags = CacheFlags(),
                  platform: Platform = PLATFORMS[DEFAULT_PLATFORM], cpu: CpuFeatures | None = None) -> EngineSizing:
    """`cpu`: the engine's CPU on the CPU platform (default: this machine's); ignored on another platform."""
    hybrid = read_hybrid_config(config)
    if flags.tensor_parallel_size < 1:
        raise InvalidArgument(f"--tensor-parallel-size must be at least 1, got {flags.tensor_parallel_size}")
    cpu = (cpu or detect()) if platform.name == "cpu" else None
    dtypes = resolve_dtypes(hybrid, flags, platform, cpu)
    layout = hybrid_layout(hybrid, model, kv_dtype=dtypes.kv, conv_dtype=dtypes.conv, ssm_dtype=dtypes.ssm,
                           tp_size=flags.tensor_parallel_size)
    kernel_block = flags.kernel_block_size or platform.kernel_block
    block_size = flags.block_size or platform.default_block
    if kernel_block < 1 or block_size < 1:
        raise InvalidArgument(f"block sizes must be positive, got --block-size {block_size}, kernel block "
                              f"{kernel_block}")
    alignment = max(kernel_block, block_size)
    n = max(block_size, _round_up(unified_block_size(layout, alignment), kernel_block))
    return EngineSizing(layout, n, alignment, platform, dtypes, cpu)


def resolve_dtypes(config: HybridConfig, flags: CacheFlags, platform: Platform,
                   cpu: CpuFeatures | None = None) -> Dtypes:
    """What vLLM caches in for these flags. `auto`: the model's dtype (ModelConfig: the config's, float32 weights
    served in bfloat16) for the weights, KV (--kv-cache-dtype) and conv state (--mamba-cache-dtype); the recurrent
    state (--mamba-ssm-cache-dtype) follows the conv state unless vLLM's model hook names another (Qwen3.5: the
    config's `mamba_ssm_dtype`; Nemotron-H: its `mamba_ssm_cache_dtype`, else float32), and on the CPU platform, where
    the CPU has AVX-512 BF16 (`cpu`, as engine_sizing resolved it), an SSM state not in float32 is reset to it
    (CpuPlatform.check_and_update_config), except a bfloat16 or float16 one that vLLM's CPU Gated DeltaNet kernel
    takes; without AVX-512 BF16 nothing is reset."""
    if flags.dtype == "auto":
        model = _dtype("config.json's dtype", config.dtype or "bfloat16", MODEL_DTYPES)
        model = "bfloat16" if model == "float32" else model
    else:
        model = _dtype("--dtype", flags.dtype, MODEL_DTYPES)
    kv = model if flags.kv_cache_dtype == "auto" else _dtype("--kv-cache-dtype", flags.kv_cache_dtype, KV_CACHE_DTYPES)
    conv = model if flags.mamba_cache_dtype == "auto" else _dtype("--mamba-cache-dtype", flags.mamba_cache_dtype,
                                                                  STATE_DTYPES)
    ssm = flags.mamba_ssm_cache_dtype
    if ssm == "auto" and config.family == "mamba2":
        ssm = config.ssm_dtype or "float32"
    elif ssm == "auto" and config.model_type != "qwen3_next":  # Qwen3.5's hook; Qwen3-Next has none
        ssm = config.ssm_dtype or "auto"
    if platform.name == "cpu" and cpu is not None and cpu.accelerated_gdn and ssm != "float32" \
            and not (config.family == "gated_deltanet" and ssm in ("bfloat16", "float16")):
        ssm = "float32"
    ssm = conv if ssm == "auto" else _dtype("--mamba-ssm-cache-dtype", ssm, STATE_DTYPES)
    return Dtypes(model, kv, conv, ssm)


def _dtype(flag: str, name: str, allowed: tuple[str, ...]) -> str:
    if name not in allowed or name == "auto":
        raise InvalidArgument(f"{flag} {name!r} is not one tiercache sizes (known: {', '.join(allowed)})")
    return _DTYPES[name]


def _round_up(value: int, multiple: int) -> int:
    return multiple * math.ceil(value / multiple)
