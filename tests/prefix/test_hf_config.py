"""A hybrid model's layout read from its config.json: the families' published field names (text_config nesting,
layer_types, Nemotron-H's hybrid_override_pattern) give the presets' layouts, and what is not a known hybrid is one
clear error. (N from these layouts: tests/prefix/test_block_size.py.)"""

from __future__ import annotations

import pytest

from tiercache.errors import InvalidArgument
from tiercache.prefix.hf_config import hybrid_layout, model_kinds, read_hybrid_config
from tiercache.prefix.presets import preset
from tests.prefix.hf_configs import QWEN35_08B, published_config


def _layout(config: dict, name: str, **dtypes):
    dtypes = {"kv_dtype": "bfloat16", "conv_dtype": "bfloat16", "ssm_dtype": "float32", **dtypes}
    return hybrid_layout(read_hybrid_config(config), name, **dtypes)


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "nemotron-h-8b"])
def test_a_published_config_gives_the_presets_layout(name):
    ssm = "bfloat16" if name.startswith("qwen3-next") else "float32"
    assert _layout(published_config(name), name, ssm_dtype=ssm).groups == preset(name).groups


def test_layer_types_interval_and_pattern_name_the_same_layers():
    text = QWEN35_08B["text_config"]
    by_interval = {k: v for k, v in text.items() if k != "layer_types"} | {"full_attention_interval": 4}
    assert _layout(by_interval, "m").groups == _layout(text, "m").groups == _layout(QWEN35_08B, "m").groups
    pattern = published_config("nemotron-h-8b")
    words = {"M": "mamba", "*": "attention", "-": "mlp"}
    by_words = {k: v for k, v in pattern.items() if k != "hybrid_override_pattern"} | {
        "layers_block_type": [words[c] for c in pattern["hybrid_override_pattern"]]}
    assert _layout(by_words, "m").groups == _layout(pattern, "m").groups


def test_a_text_config_without_its_type_is_the_models_text_model():
    text = {k: v for k, v in QWEN35_08B["text_config"].items() if k != "model_type"}
    config = read_hybrid_config({"model_type": "qwen3_5", "text_config": text})
    assert config.model_type == "qwen3_5_text" and config.ssm_dtype == "float32" and config.dtype == "bfloat16"


@pytest.mark.parametrize("config,message", [
    ({"model_type": "llama"}, "model_type 'llama' is not a hybrid model tiercache knows (known: qwen3_next"),
    ({"model_type": "qwen3_next", "layer_types": ["full_attention", "sliding_attention"]},
     "qwen3_next: unknown layer_types ['sliding_attention']"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
     "qwen3_next config.json has no 'num_key_value_heads'"),
])
def test_what_cannot_be_read_is_one_line(config, message):
    with pytest.raises(InvalidArgument) as refused:
        _layout(config, "m")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize("config,hybrid,attention_free,mla", [
    (QWEN35_08B, True, False, False),
    (published_config("nemotron-h-8b"), True, False, False),
    ({"model_type": "llama", "num_key_value_heads": 8}, False, False, False),
    ({"model_type": "mamba2"}, False, True, False),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, False, False, True),
    ({"model_type": "some_new_hybrid", "layer_types": ["linear_attention", "full_attention"]}, True, False, False),
])
def test_model_kinds_of_any_config(config, hybrid, attention_free, mla):
    kinds = model_kinds(config)
    assert (kinds.hybrid, kinds.attention_free, kinds.mla) == (hybrid, attention_free, mla)
