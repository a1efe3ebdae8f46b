"""Layouts of published hybrid models, from their configs (layer pattern, heads, dims, dtypes)."""

from __future__ import annotations

from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import GroupKind, LayerGroup, ModelLayout, StateTensor


def gated_deltanet_layout(model: str, *, layers: int, full_attention_interval: int, kv_heads: int, head_dim: int,
                          key_heads: int, value_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                          kv_dtype: str = "bfloat16", conv_dtype: str = "bfloat16", ssm_dtype: str = "float32",
                          revision: str = "main", tp_rank: int = 0, tp_size: int = 1) -> ModelLayout:
    """Qwen3.5 / Qwen3-Next style: every `full_attention_interval`-th layer is full attention, the rest Gated DeltaNet.

    A GDN layer's state is its conv window (conv_kernel - 1 columns over q, k and v channels) and its recurrent
    state (one key_dim x value_dim matrix per value head, kept in float32 even in bf16 models).
    """
    attention = tuple(i for i in range(layers) if (i + 1) % full_attention_interval == 0)
    recurrent = tuple(i for i in range(layers) if (i + 1) % full_attention_interval != 0)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    for name, n in (("kv_heads", kv_heads), ("key_heads", key_heads), ("value_heads", value_heads)):
        if n % tp_size:
            raise InvalidArgument(f"{name}={n} does not split over tp_size={tp_size}")
    state = (
        StateTensor("conv", (conv_dim // tp_size, conv_kernel - 1), conv_dtype),
        StateTensor("recurrent", (value_heads // tp_size, key_dim, value_dim), ssm_dtype),
    )
    return ModelLayout(model, (
        LayerGroup(GroupKind.FULL_ATTENTION, attention, kv_heads=kv_heads // tp_size, head_dim=head_dim,
                   kv_dtype=kv_dtype),
        LayerGroup(GroupKind.RECURRENT, recurrent, state=state),
    ), revision=revision, tp_rank=tp_rank, tp_size=tp_size)


PRESETS = {
    "qwen3.5-0.8b": lambda **kw: gated_deltanet_layout(
        "Qwen/Qwen3.5-0.8B", layers=24, full_attention_interval=4, kv_heads=2, head_dim=256, key_heads=16,
        value_heads=16, key_dim=128, value_dim=128, conv_kernel=4, **kw),
    "qwen3.5-4b": lambda **kw: gated_deltanet_layout(
        "Qwen/Qwen3.5-4B", layers=32, full_attention_interval=4, kv_heads=4, head_dim=256, key_heads=16,
        value_heads=32, key_dim=128, value_dim=128, conv_kernel=4, **kw),
    "qwen3.6-27b": lambda **kw: gated_deltanet_layout(
        "Qwen/Qwen3.6-27B", layers=64, full_attention_interval=4, kv_heads=4, head_dim=256, key_heads=16,
        value_heads=48, key_dim=128, value_dim=128, conv_kernel=4, **kw),
}


def preset(name: str, **options) -> ModelLayout:
    try:
        return PRESETS[name.lower()](**options)
    except KeyError:
        raise InvalidArgument(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
