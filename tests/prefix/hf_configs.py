"""config.json of every preset's model, in the fields and nesting the published files use (Qwen3.5 / 3.6 nest the
text model under `text_config` and ask for a float32 GDN state with `mamba_ssm_dtype`; Qwen3-Next is flat and asks
for none; Nemotron-H names its layers with `hybrid_override_pattern`). Only what decides the cache is kept."""

from __future__ import annotations


def _qwen35(layers: int, kv_heads: int, value_heads: int, moe: bool = False) -> dict:
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    return {"model_type": kind, "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {
        "model_type": f"{kind}_text", "num_hidden_layers": layers,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32", "dtype": "bfloat16"}}


def _qwen3_next(layers: int, kv_heads: int, value_heads: int) -> dict:
    return {"model_type": "qwen3_next", "num_hidden_layers": layers, "full_attention_interval": 4,
            "num_attention_heads": 16, "num_key_value_heads": kv_heads, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": value_heads, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"}


def _nemotron_h(pattern: str, kv_heads: int, mamba_heads: int, mamba_head_dim: int) -> dict:
    return {"model_type": "nemotron_h", "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern),
            "num_attention_heads": 32, "num_key_value_heads": kv_heads, "head_dim": 128,
            "mamba_num_heads": mamba_heads, "mamba_head_dim": mamba_head_dim, "ssm_state_size": 128, "n_groups": 8,
            "conv_kernel": 4, "torch_dtype": "bfloat16"}


CONFIGS = {
    "qwen3.5-0.8b": _qwen35(24, 2, 16), "qwen3.5-2b": _qwen35(24, 2, 16), "qwen3.5-4b": _qwen35(32, 4, 32),
    "qwen3.5-9b": _qwen35(32, 4, 32), "qwen3.5-27b": _qwen35(64, 4, 48),
    "qwen3.5-35b-a3b": _qwen35(40, 2, 32, moe=True), "qwen3.5-122b-a10b": _qwen35(48, 2, 64, moe=True),
    "qwen3.5-397b-a17b": _qwen35(60, 2, 64, moe=True), "qwen3.6-27b": _qwen35(64, 4, 48),
    "qwen3.6-35b-a3b": _qwen35(40, 2, 32, moe=True), "qwen3-next-80b-a3b": _qwen3_next(48, 2, 32),
    "nemotron-h-8b": _nemotron_h("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 8, 128, 64),
    "nemotron-nano-9b-v2": _nemotron_h("M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-", 8, 128, 80),
    "nemotron-3-nano-30b-a3b": _nemotron_h("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 2, 64, 64),
}
QWEN35_08B = CONFIGS["qwen3.5-0.8b"]


def published_config(name: str) -> dict:
    return CONFIGS[name]
