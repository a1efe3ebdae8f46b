"""vLLM's block size N before a start (tiercache.prefix.block_size): every preset read from its config.json gives the
preset's layout and N; on the CPU platform, the N vLLM's CPU engine chose for the real-engine test models on a CPU
with AVX-512 BF16 and on one without (tests/vllm_engine/test_block_size.py checks the same against the engine's log,
on this machine and with AVX2 stood in); and each flag that changes N or the bytes changes them as vLLM does."""

from __future__ import annotations

import pytest

from tiercache.errors import InvalidArgument
from tiercache.prefix.block_size import PLATFORMS, CacheFlags, engine_sizing
from tiercache.prefix.cpu_features import parse
from tiercache.prefix.layout import unified_block_size
from tiercache.prefix.presets import PRESETS, preset
from tests.prefix.hf_configs import CONFIGS, QWEN35_08B
from testkit.vllm_models import FOUR_LAYER, SIX_LAYER

CPU = PLATFORMS["cpu"]
AVX512_BF16, AVX2 = parse("avx512_bf16"), parse("avx2")


def test_every_preset_has_its_config():
    assert set(CONFIGS) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_config_gives_its_presets_layout_and_n_on_a_gpu(name):
    sizing = engine_sizing(CONFIGS[name], preset(name).model)
    assert sizing.layout == preset(name)
    assert sizing.block_tokens == unified_block_size(preset(name)) and sizing.kernel_alignment == 16


def test_qwen35_08b_as_the_docs_size_it():
    sizing = engine_sizing(QWEN35_08B, "Qwen/Qwen3.5-0.8B")
    assert sizing.block_tokens == 544
    assert sizing.kv_bytes_per_token_per_layer == 2048 and sizing.layout.kv_bytes_per_token == 12 * 1024
    assert sizing.state_bytes_per_layer == 1_085_440  # conv 6144 x 3 bf16 + 16 x 128 x 128 float32
    assert sizing.kv_chunk_bytes == 544 * 12 * 1024


@pytest.mark.parametrize("model,flags,cpu,n", [
    # AVX-512 BF16: the GDN state reset to float32, 67 KiB: two 128-token pages of 512 B/token
    (FOUR_LAYER, CacheFlags(), AVX512_BF16, 256),
    (SIX_LAYER, CacheFlags(), AVX512_BF16, 128),  # 4 KV heads of 128: one page of 128 tokens holds it
    (FOUR_LAYER, CacheFlags(mamba_ssm_cache_dtype="bfloat16"), AVX512_BF16, 128),  # the CPU GDN kernel keeps bf16
    (SIX_LAYER, CacheFlags(block_size=256), AVX512_BF16, 256),
    # AVX2: nothing reset, a bf16 state, one page (tests/vllm_engine/test_block_size.py checks both models against
    # vLLM's engine with AVX2 stood in)
    (FOUR_LAYER, CacheFlags(), AVX2, 128),
    (SIX_LAYER, CacheFlags(), AVX2, 128),
    (FOUR_LAYER, CacheFlags(mamba_ssm_cache_dtype="float32"), AVX2, 256),  # asked for: as AVX-512 BF16's default
])
def test_the_cpu_platform_gives_the_n_of_vllms_cpu_engine(model, flags, cpu, n):
    assert engine_sizing(model.config_fields(), model.name, flags, CPU, cpu).block_tokens == n


def test_the_cpu_platform_resets_an_auto_ssm_state_to_float32_only_with_avx512_bf16():
    assert engine_sizing(FOUR_LAYER.config_fields(), "m", platform=CPU, cpu=AVX512_BF16).dtypes.ssm == "float32"
    assert engine_sizing(FOUR_LAYER.config_fields(), "m", platform=CPU, cpu=AVX2).dtypes.ssm == "bfloat16"
    assert engine_sizing(FOUR_LAYER.config_fields(), "m").dtypes.ssm == "bfloat16"  # a GPU follows the conv state
    nemotron, bf16 = CONFIGS["nemotron-h-8b"], CacheFlags(mamba_ssm_cache_dtype="bfloat16")
    assert engine_sizing(nemotron, "m", bf16, CPU, AVX512_BF16).dtypes.ssm == "float32"  # not a GDN state
    assert engine_sizing(nemotron, "m", bf16, CPU, AVX2).dtypes.ssm == "bfloat16"
    assert engine_sizing(nemotron, "m", bf16).dtypes.ssm == "bfloat16"


def test_the_cpu_platform_reads_this_machines_cpu_by_default():
    sizing = engine_sizing(FOUR_LAYER.config_fields(), "m", platform=CPU)
    assert sizing.cpu is not None and sizing.cpu.source.startswith("this machine")
    assert engine_sizing(FOUR_LAYER.config_fields(), "m").cpu is None  # a GPU engine's host CPU decides nothing


@pytest.mark.parametrize("flags,n", [
    (CacheFlags(), 544),
    (CacheFlags(kernel_block_size=128), 640),  # FlashAttention 4's head-dim-256 pages on Blackwell
    (CacheFlags(kv_cache_dtype="fp8"), 1072),  # half the KV per token: twice the tokens per state
    (CacheFlags(tensor_parallel_size=2), 544),  # KV heads and the state both halve
    (CacheFlags(block_size=1024), 1024),  # a --block-size above the state's is kept
    (CacheFlags(mamba_ssm_cache_dtype="bfloat16"), 288),  # overrides the config's mamba_ssm_dtype
])
def test_flags_change_n_as_vllm_does(flags, n):
    assert engine_sizing(QWEN35_08B, "m", flags).block_tokens == n


def test_dtypes_resolve_as_vllm_resolves_auto():
    float32_weights = {**QWEN35_08B, "text_config": {**QWEN35_08B["text_config"], "dtype": "float32"}}
    assert engine_sizing(float32_weights, "m").dtypes.kv == "bfloat16"  # vLLM serves float32 weights in bf16
    assert engine_sizing(QWEN35_08B, "m", CacheFlags(dtype="float32")).dtypes.kv == "float32"
    sizing = engine_sizing(QWEN35_08B, "m", CacheFlags(kv_cache_dtype="fp8_e5m2", mamba_cache_dtype="float32"))
    assert (sizing.dtypes.kv, sizing.dtypes.conv, sizing.dtypes.ssm) == ("float8_e5m2", "float32", "float32")
    assert engine_sizing(CONFIGS["nemotron-h-8b"], "m").dtypes.ssm == "float32"  # vLLM's Nemotron-H default


@pytest.mark.parametrize("flags,message", [
    (CacheFlags(kv_cache_dtype="nvfp4"), "--kv-cache-dtype 'nvfp4' is not one tiercache sizes"),
    (CacheFlags(tensor_parallel_size=3), "kv_heads=2 does not split over tp_size=3"),
])
def test_what_cannot_be_sized_is_one_line(flags, message):
    with pytest.raises(InvalidArgument, match=message):
        engine_sizing(QWEN35_08B, "m", flags)
