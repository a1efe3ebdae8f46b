"""A hybrid model's layout from its Hugging Face `config.json`, before any engine reads it.

The families the presets cover, read with the presets' own functions: Gated DeltaNet + full attention (`qwen3_next`,
and `qwen3_5` / `qwen3_5_moe`, whose text model is nested under `text_config`) and Mamba2 + attention
(`nemotron_h`). Which layer is which comes from the config's `layer_types` (or `hybrid_override_pattern`, or
`full_attention_interval`), as vLLM's model classes read it. The dtypes are the caller's: which ones an engine caches
in is the engine's rule (tiercache.prefix.block_size for vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tiercache.errors import InvalidArgument
from tiercache.prefix.layout import ModelLayout
from tiercache.prefix.presets import gated_deltanet_layout, mamba2_layout

GATED_DELTANET = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
MAMBA2 = ("nemotron_h",)
PURE_MAMBA = ("mamba", "mamba2", "falcon_mamba")  # no attention layers at all
# layer_types' words (and Nemotron-H's older ones) as mamba2_layout's pattern characters
_PATTERN = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


@dataclass(frozen=True)
class HybridConfig:
    """The text model's part of a config.json that decides what an engine caches."""

    model_type: str  # the text model's (qwen3_5's is qwen3_5_text)
    fields: Mapping[str, Any]
    dtype: str | None  # the weights' dtype the config names (`dtype`, or `torch_dtype` before transformers 5)

    @property
    def family(self) -> str:
        return "gated_deltanet" if self.model_type in GATED_DELTANET else "mamba2"

    @property
    def ssm_dtype(self) -> str | None:
        """The recurrent state's dtype the config asks for: Qwen3.5's `mamba_ssm_dtype`, Nemotron-H's
        `mamba_ssm_cache_dtype` (None: the config names none)."""
        return self.fields.get("mamba_ssm_dtype") or self.fields.get("mamba_ssm_cache_dtype")

    def layer_kinds(self) -> str:
        """One character per layer, mamba2_layout's alphabet: M recurrent, * attention, - MLP, E MoE."""
        kinds = self.fields.get("layer_types") or self.fields.get("layers_block_type")
        if kinds:
            unknown = sorted(set(kinds) - set(_PATTERN))
            if unknown:
                raise InvalidArgument(f"{self.model_type}: unknown layer_types {unknown}")
            return "".join(_PATTERN[kind] for kind in kinds)
        if "hybrid_override_pattern" in self.fields:
            return self.fields["hybrid_override_pattern"]
        interval = self.fields.get("full_attention_interval", 4)
        return "".join("*" if (i + 1) % interval == 0 else "M" for i in range(self.required("num_hidden_layers")))

    def required(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise InvalidArgument(f"{self.model_type} config.json has no {name!r}") from None


@dataclass(frozen=True)
class ModelKinds:
    """What kinds of layers a config.json describes, for any model (the families above or not)."""

    model_type: str
    recurrent: bool  # Mamba / Gated DeltaNet layers
    attention_free: bool  # recurrent layers only
    mla: bool  # Multi-head Latent Attention (DeepSeek's `kv_lora_rank`)

    @property
    def hybrid(self) -> bool:
        return self.recurrent and not self.attention_free


def model_kinds(config: Mapping[str, Any]) -> ModelKinds:
    text = config.get("text_config") or config
    model_type = str(text.get("model_type") or config.get("model_type"))
    kinds = set(text.get("layer_types") or text.get("layers_block_type") or ())
    attention_free = model_type in PURE_MAMBA
    recurrent = (attention_free or model_type in GATED_DELTANET + MAMBA2 or bool(kinds & {"linear_attention", "mamba"})
                 or "M" in str(text.get("hybrid_override_pattern", "")))
    return ModelKinds(model_type, recurrent, attention_free, bool(text.get("kv_lora_rank")))


def read_hybrid_config(config: Mapping[str, Any]) -> HybridConfig:
    """The config's text model, or one line saying which model types are known."""
    text = config.get("text_config") or config
    model_type = text.get("model_type")
    if model_type is None and text is not config:  # a text_config that does not name its type: qwen3_5's is _text
        model_type = f"{config.get('model_type')}_text"
    if model_type not in GATED_DELTANET + MAMBA2:
        raise InvalidArgument(f"model_type {model_type!r} is not a hybrid model tiercache knows (known: "
                              f"{', '.join(GATED_DELTANET + MAMBA2)})")
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    return HybridConfig(model_type, text, dtype)


def hybrid_layout(config: HybridConfig, model: str, *, kv_dtype: str, conv_dtype: str, ssm_dtype: str,
                  tp_size: int = 1) -> ModelLayout:
    """One tensor-parallel rank's layout (rank 0: every rank's shapes are the same)."""
    f = config.required
    kinds = config.layer_kinds()
    dtypes = dict(kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype, tp_size=tp_size)
    if config.family == "gated_deltanet":
        attention = tuple(i for i, kind in enumerate(kinds) if kind == "*")
        return gated_deltanet_layout(
            model, layers=len(kinds), attention_layers=attention, kv_heads=f("num_key_value_heads"),
            head_dim=config.fields.get("head_dim") or f("hidden_size") // f("num_attention_heads"),
            key_heads=f("linear_num_key_heads"), value_heads=f("linear_num_value_heads"),
            key_dim=f("linear_key_head_dim"), value_dim=f("linear_value_head_dim"),
            conv_kernel=f("linear_conv_kernel_dim"), **dtypes)
    return mamba2_layout(
        model, pattern=kinds, kv_heads=f("num_key_value_heads"),
        head_dim=config.fields.get("head_dim") or f("hidden_size") // f("num_attention_heads"),
        mamba_heads=f("mamba_num_heads"), mamba_head_dim=f("mamba_head_dim"), state_size=f("ssm_state_size"),
        n_groups=f("n_groups"), conv_kernel=f("conv_kernel"), **dtypes)
