"""Layouts of published hybrid models, from their configs (layer pattern, heads, dims, dtypes), as vLLM caches them.

Each preset's numbers are the model's published `config.json` fields (the sources are listed in docs/deploy.md,
"Sizing"); the state shapes and dtypes are the ones vLLM derives from them (vllm/model_executor/layers/mamba/
mamba_utils.py: `gated_delta_net_state_shape`, `mamba2_state_shape`; dtypes from `mamba_ssm_cache_dtype`), so N and
every object size here are those of a vLLM engine with the default `--kv-cache-dtype auto` (bf16 KV).

Tensor parallelism divides heads as vLLM does: attention KV heads split when TP divides them and are replicated
(one per rank) when TP is a multiple of them; recurrent heads and channels split.
"""

from __future__ import annotations

from typing import Callable

from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor


def kv_heads_per_rank(kv_heads: int, tp_size: int) -> int:
    """vLLM's `get_num_kv_heads`: kv_heads / TP, or 1 (replicated) when TP is a multiple of kv_heads."""
    if kv_heads % tp_size == 0:
        return kv_heads // tp_size
    if tp_size % kv_heads == 0:
        return 1
    raise InvalidArgument(f"kv_heads={kv_heads} does not split over tp_size={tp_size}")


def _split(name: str, n: int, tp_size: int) -> int:
    if n % tp_size:
        raise InvalidArgument(f"{name}={n} does not split over tp_size={tp_size}")
    return n // tp_size


def gated_deltanet_layout(model: str, *, layers: int, kv_heads: int, head_dim: int, key_heads: int,
                          value_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                          full_attention_interval: int = 4, attention_layers: tuple[int, ...] | None = None,
                          kv_dtype: str = "bfloat16", conv_dtype: str = "bfloat16", ssm_dtype: str = "float32",
                          revision: str = "main", tp_rank: int = 0, tp_size: int = 1) -> ModelLayout:
    """Qwen3.5 / Qwen3-Next style: every `full_attention_interval`-th layer is full attention (or the layers
    `attention_layers` names, as a config's `layer_types` does), the rest Gated DeltaNet.

    A GDN layer's state is its conv window (conv_kernel - 1 columns over q, k and v channels) and its recurrent
    state (one key_dim x value_dim matrix per value head; float32 where the config's `mamba_ssm_dtype` says so, as
    Qwen3.5's does).
    """
    if attention_layers is None:
        attention_layers = tuple(i for i in range(layers) if (i + 1) % full_attention_interval == 0)
    attention = tuple(attention_layers)
    recurrent = tuple(i for i in range(layers) if i not in attention)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    kv_per_rank = kv_heads_per_rank(kv_heads, tp_size)
    _split("key_heads", key_heads, tp_size)
    state = (
        StateTensor("conv", (_split("conv channels", conv_dim, tp_size), conv_kernel - 1), conv_dtype),
        StateTensor("recurrent", (_split("value_heads", value_heads, tp_size), key_dim, value_dim), ssm_dtype),
    )
    return ModelLayout(model, (
        LayerGroup(GroupKind.FULL_ATTENTION, attention, kv_heads=kv_per_rank, head_dim=head_dim, kv_dtype=kv_dtype),
        LayerGroup(GroupKind.RECURRENT, recurrent, state=state),
    ), revision=revision, tp_rank=tp_rank, tp_size=tp_size)


def mamba2_layout(model: str, *, pattern: str, kv_heads: int, head_dim: int, mamba_heads: int, mamba_head_dim: int,
                  state_size: int, n_groups: int, conv_kernel: int, kv_dtype: str = "bfloat16",
                  conv_dtype: str = "bfloat16", ssm_dtype: str = "float32", revision: str = "main", tp_rank: int = 0,
                  tp_size: int = 1) -> ModelLayout:
    """Nemotron-H style: `pattern` is the config's `hybrid_override_pattern`, one character per layer: `M` Mamba2,
    `*` attention, `-` MLP and `E` MoE (neither caches anything).

    A Mamba2 layer's state is its conv window (conv_kernel - 1 columns over the x, B and C channels: heads x head
    dim + 2 x groups x state size) and its SSM state (heads x head_dim x state_size, float32 by default: vLLM's
    `NemotronHForCausalLMConfig` takes the config's `mamba_ssm_cache_dtype`, else float32). Groups that do not split
    over TP are replicated so each rank holds the groups its heads need (vLLM's `extra_groups_for_head_shards`).
    """
    if set(pattern) - set("M*-E"):
        raise InvalidArgument(f"unknown layer kinds in pattern {pattern!r} (M, *, -, E)")
    kv_per_rank = kv_heads_per_rank(kv_heads, tp_size)
    groups = n_groups if n_groups % tp_size == 0 else tp_size  # vLLM: n_groups + (tp_size - n_groups)
    conv_dim = mamba_heads * mamba_head_dim + 2 * groups * state_size
    state = (
        StateTensor("conv", (_split("conv channels", conv_dim, tp_size), conv_kernel - 1), conv_dtype),
        StateTensor("ssm", (_split("mamba_heads", mamba_heads, tp_size), mamba_head_dim, state_size), ssm_dtype),
    )
    return ModelLayout(model, (
        LayerGroup(GroupKind.FULL_ATTENTION, tuple(i for i, c in enumerate(pattern) if c == "*"),
                   kv_heads=kv_per_rank, head_dim=head_dim, kv_dtype=kv_dtype),
        LayerGroup(GroupKind.RECURRENT, tuple(i for i, c in enumerate(pattern) if c == "M"), state=state),
    ), revision=revision, tp_rank=tp_rank, tp_size=tp_size, num_layers=len(pattern))


def _qwen(model: str, layers: int, kv_heads: int, value_heads: int, **fixed) -> Callable[..., ModelLayout]:
    """Qwen3.5 / 3.6 / Qwen3-Next: every 4th layer full attention (head_dim 256), GDN with 16 key heads of 128 and
    `value_heads` value heads of 128, conv kernel 4."""
    def build(**options) -> ModelLayout:
        return gated_deltanet_layout(model, layers=layers, full_attention_interval=4, kv_heads=kv_heads,
                                     head_dim=256, key_heads=16, value_heads=value_heads, key_dim=128, value_dim=128,
                                     conv_kernel=4, **{**fixed, **options})
    return build


def _nemotron_h(model: str, pattern: str, kv_heads: int, mamba_heads: int, mamba_head_dim: int,
                state_size: int = 128) -> Callable[..., ModelLayout]:
    """Nemotron-H: attention heads of 128, 8 SSM groups, conv kernel 4."""
    def build(**options) -> ModelLayout:
        return mamba2_layout(model, pattern=pattern, kv_heads=kv_heads, head_dim=128, mamba_heads=mamba_heads,
                             mamba_head_dim=mamba_head_dim, state_size=state_size, n_groups=8, conv_kernel=4,
                             **options)
    return build


# Qwen3.5 keeps its GDN state in float32 (`"mamba_ssm_dtype": "float32"` in its config; vLLM's
# Qwen3_5ForConditionalGenerationConfig takes it). Qwen3-Next's config has no such field and vLLM has no override
# for it: its state follows the model dtype (bf16) unless `--mamba-ssm-cache-dtype float32` is passed.
PRESETS: dict[str, Callable[..., ModelLayout]] = {
    "qwen3.5-0.8b": _qwen("Qwen/Qwen3.5-0.8B", layers=24, kv_heads=2, value_heads=16),
    "qwen3.5-2b": _qwen("Qwen/Qwen3.5-2B", layers=24, kv_heads=2, value_heads=16),
    "qwen3.5-4b": _qwen("Qwen/Qwen3.5-4B", layers=32, kv_heads=4, value_heads=32),
    "qwen3.5-9b": _qwen("Qwen/Qwen3.5-9B", layers=32, kv_heads=4, value_heads=32),
    "qwen3.5-27b": _qwen("Qwen/Qwen3.5-27B", layers=64, kv_heads=4, value_heads=48),
    "qwen3.5-35b-a3b": _qwen("Qwen/Qwen3.5-35B-A3B", layers=40, kv_heads=2, value_heads=32),
    "qwen3.5-122b-a10b": _qwen("Qwen/Qwen3.5-122B-A10B", layers=48, kv_heads=2, value_heads=64),
    "qwen3.5-397b-a17b": _qwen("Qwen/Qwen3.5-397B-A17B", layers=60, kv_heads=2, value_heads=64),
    "qwen3.6-27b": _qwen("Qwen/Qwen3.6-27B", layers=64, kv_heads=4, value_heads=48),
    "qwen3.6-35b-a3b": _qwen("Qwen/Qwen3.6-35B-A3B", layers=40, kv_heads=2, value_heads=32),
    "qwen3-next-80b-a3b": _qwen("Qwen/Qwen3-Next-80B-A3B-Instruct", layers=48, kv_heads=2, value_heads=32,
                                ssm_dtype="bfloat16"),
    "nemotron-h-8b": _nemotron_h("nvidia/Nemotron-H-8B-Base-8K",
                                 "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", kv_heads=8,
                                 mamba_heads=128, mamba_head_dim=64),
    "nemotron-nano-9b-v2": _nemotron_h("nvidia/NVIDIA-Nemotron-Nano-9B-v2",
                                       "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", kv_heads=8,
                                       mamba_heads=128, mamba_head_dim=80),
    "nemotron-3-nano-30b-a3b": _nemotron_h("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
                                           "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", kv_heads=2,
                                           mamba_heads=64, mamba_head_dim=64),
}

# The tensor-parallel size each preset is documented at (docs/deploy.md, "Sizing"): the smallest one its published
# serving recipe uses. The default server.max_chunk_bytes holds every preset's largest object at this size.
DOCUMENTED_TP = {"qwen3.5-397b-a17b": 8}


def preset(name: str, **options) -> ModelLayout:
    try:
        build = PRESETS[name.lower()]
    except KeyError:
        raise InvalidArgument(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
    return build(**options)
